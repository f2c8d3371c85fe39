"""The generalized face discovery (GFD) split of a face manifest: known / unknown identities, labelled images.

Rules (FaceGCD App. B), all drawn from one ``np.random.default_rng(seed)``, rounding half up:

1. Of the shuffled sorted identity names, the first round(known_fraction · n_ids) are known, the rest unknown.
2. Per identity with n ≥ 2 images, clip(round(test_fraction · n), 1, n − 1) random images are ``test`` (90/10 by
   default), the rest ``train``; an identity with one image is train only.
3. Per known identity, clip(round(labelled_fraction · n_train), 1, n_train) random train images are labelled;
   unknown identities and test images never are.

Images are ordered by (identity, path) before drawing, so the split depends on the rows and the seed, not on their
order; the returned frame keeps the manifest's order. Differences from the reference: the paper first keeps the
identities with ≥ 100 (YTF) / 50 (CASIA) images and samples a fixed number of them (filter the manifest before
``gfd_split``); its rounding of 10 % and 50 % is not stated.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from ml.errors import ConfigError, DataError

__all__ = ["GFD_COLUMNS", "check_gfd_split", "gfd_split", "read_gfd_split", "write_gfd_split"]

GFD_COLUMNS: tuple[str, ...] = ("path", "identity", "known", "labelled", "subset")
SUBSETS = ("train", "test")


def _round_half_up(x: np.ndarray) -> np.ndarray:
    return np.floor(np.asarray(x, dtype=np.float64) + 0.5).astype(np.int64)


def _fraction(value: object, name: str, *, low_open: bool, high_open: bool) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = (0 < value if low_open else 0 <= value) and (value < 1 if high_open else value <= 1)
    if not ok:
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be a number in {interval}; got {value!r}")
    return float(value)


def _rows(index: pd.Index, hit: np.ndarray) -> str:
    """'rows [3, 7, 9] (3 in all)' naming up to five index labels where ``hit`` is True."""
    where = index[np.asarray(hit, dtype=bool)]
    return f"rows {list(where[:5])}{' ...' if len(where) > 5 else ''} ({len(where)} in all)"


def gfd_split(
    manifest: pd.DataFrame,
    *,
    seed: int = 0,
    known_fraction: float = 0.5,
    labelled_fraction: float = 0.5,
    test_fraction: float = 0.1,
) -> pd.DataFrame:
    """The GFD split of ``manifest`` (needs ``path`` and ``identity``; see the module doc for the rules).

    Args:
        manifest: one row per image; ``path`` unique, ``identity`` a string; other columns are ignored.
        seed: non-negative integer seed of the one random generator.
        known_fraction: share of identities that are known, in (0, 1].
        labelled_fraction: share of each known identity's train images that are labelled, in (0, 1].
        test_fraction: share of each identity's images held out for test, in (0, 1).

    Returns:
        One row per manifest row, in manifest order (index reset): ``path``, ``identity`` (str),
        ``known`` (bool), ``labelled`` (bool), ``subset`` ("train" | "test").
    """
    known_fraction = _fraction(known_fraction, "known_fraction", low_open=True, high_open=False)
    labelled_fraction = _fraction(labelled_fraction, "labelled_fraction", low_open=True, high_open=False)
    test_fraction = _fraction(test_fraction, "test_fraction", low_open=True, high_open=True)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0; got {seed!r}")
    missing = [c for c in ("path", "identity") if c not in manifest.columns]
    if missing:
        raise DataError(f"manifest is missing column(s) {missing}; a GFD split needs 'path' and 'identity'")
    if len(manifest) == 0:
        raise DataError("manifest has no rows; nothing to split")
    for column in ("path", "identity"):
        null = manifest[column].isna().to_numpy()
        if null.any():
            raise DataError(f"manifest column '{column}' is null in {_rows(manifest.index, null)}; set it on every row")
        if pd.api.types.infer_dtype(manifest[column], skipna=False) != "string":
            raise DataError(f"manifest column '{column}' must hold strings; got {manifest[column].dtype}")
    dup = manifest["path"].duplicated(keep=False).to_numpy()
    if dup.any():
        raise DataError(f"manifest column 'path' repeats in {_rows(manifest.index, dup)}; "
                        "one image in two rows could land in train and test - deduplicate the manifest")

    path = manifest["path"].to_numpy(dtype=object)
    identity = manifest["identity"].to_numpy(dtype=object)
    names, ident = np.unique(identity, return_inverse=True)  # sorted names; ident: (N,) in 0..n_ids-1
    counts = np.bincount(ident, minlength=names.size)  # (n_ids,) images per identity
    rng = np.random.default_rng(seed)

    # 1. known identities
    n_known = int(_round_half_up(known_fraction * names.size))
    known_id = np.zeros(names.size, dtype=bool)
    known_id[rng.permutation(names.size)[:n_known]] = True

    # random position of each image within its identity; keys drawn in (identity, path) order
    canonical = np.lexsort((path.astype(str), ident))  # (N,) rows sorted by identity, then path
    key = np.empty(len(path))
    key[canonical] = rng.random(len(path))
    order = np.lexsort((key, ident))  # rows by identity, then random key
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (n_ids,) first slot of each identity
    position = np.empty(len(path), dtype=np.int64)
    position[order] = np.arange(len(path)) - starts[ident[order]]  # 0..count-1 within the identity

    # 2. test images: 1 <= n_test <= n - 1 when n >= 2, none for a single image
    n_test = np.where(counts >= 2, np.clip(_round_half_up(test_fraction * counts), 1, counts - 1), 0)
    # 3. labelled train images of known identities: 1 <= n_lab <= n_train
    n_train = counts - n_test
    n_lab = np.where(known_id, np.clip(_round_half_up(labelled_fraction * n_train), 1, n_train), 0)

    test = position < n_test[ident]
    labelled = ~test & (position < n_test[ident] + n_lab[ident])
    return pd.DataFrame({
        "path": path,
        "identity": identity,
        "known": known_id[ident],
        "labelled": labelled,
        "subset": np.where(test, "test", "train").astype(object),
    })


def check_gfd_split(df: pd.DataFrame) -> None:
    """Raise DataError naming the column or rows if ``df`` breaks the GFD split contract.

    Checks: the columns of ``GFD_COLUMNS`` exist; ``known`` and ``labelled`` are bool; ``subset`` is
    "train" or "test"; no path repeats; an identity is known on all its rows or on none; no unknown
    identity is labelled; no test image is labelled.
    """
    missing = [c for c in GFD_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"GFD split is missing column(s) {missing}; it needs {list(GFD_COLUMNS)} - build it with gfd_split")
    for column in ("known", "labelled"):
        if df[column].dtype != bool:
            raise DataError(f"GFD split column '{column}' must be bool; got {df[column].dtype}")
    bad_subset = ~df["subset"].isin(SUBSETS).to_numpy()
    if bad_subset.any():
        raise DataError(f"GFD split column 'subset' must be 'train' or 'test'; {_rows(df.index, bad_subset)} "
                        f"hold e.g. {df['subset'][bad_subset].iloc[0]!r}")
    dup = df["path"].duplicated(keep=False).to_numpy()
    if dup.any():
        raise DataError(f"GFD split column 'path' repeats in {_rows(df.index, dup)}; an image must appear once")
    mixed = df.groupby("identity", sort=True)["known"].nunique() > 1
    if mixed.any():
        names = list(mixed.index[mixed])
        rows = df["identity"].isin(names).to_numpy()
        raise DataError(f"GFD split column 'known': identities {names[:5]} are known in some rows and unknown in "
                        f"others ({_rows(df.index, rows)}); the known and unknown identity sets must not overlap")
    known = df["known"].to_numpy()
    labelled = df["labelled"].to_numpy()
    hit = labelled & ~known
    if hit.any():
        raise DataError(f"GFD split column 'labelled': {_rows(df.index, hit)} label images of unknown identities; "
                        "only known identities may be labelled")
    hit = labelled & (df["subset"] == "test").to_numpy()
    if hit.any():
        raise DataError(f"GFD split column 'labelled': {_rows(df.index, hit)} are labelled test images; "
                        "test images must be unlabelled")


def write_gfd_split(df: pd.DataFrame, path: str | os.PathLike) -> None:
    """Check ``df`` and write it as parquet atomically (a temporary file beside ``path``, then ``os.replace``)."""
    check_gfd_split(df)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_gfd_split(path: str | os.PathLike) -> pd.DataFrame:
    """Read a GFD split parquet written by ``write_gfd_split`` and check it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: GFD split not found; build it with gfd_split and write_gfd_split")
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read GFD split parquet ({exc}); rebuild it with gfd_split") from exc
    try:
        check_gfd_split(df)
    except DataError as exc:  # name the file
        raise DataError(f"{path}: {exc}") from None
    return df
