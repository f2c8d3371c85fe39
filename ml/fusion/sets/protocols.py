"""Benchmarks over fused templates: IJB 1:1 template verification (TAR@FAR), probe-set (video) identification
(rank-N and TPIR@FPIR), CAFace's rank-1 versus probe size (Fig. 1c) and its robustness to frame order (Table 4)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ml.errors import ConfigError, DataError
from ml.eval.metrics.identification import identification_rank, open_set_identification
from ml.eval.metrics.verification import pair_scores, tar_at_far
from ml.fusion.sets.fusers import (
    FUSERS, MAX_ITEMS, _check_features, _check_groups, _Groups, _positive_int, _to_numpy, fuse_templates,
)
from ml.fusion.caface import CAFace

log = logging.getLogger(__name__)

DEFAULT_FARS = (1e-5, 1e-4, 1e-3, 1e-2)


def _scalar(value: Any) -> Any:
    """A numpy scalar as its Python value, anything else (e.g. the str of an object array) as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _fmt_rate(rate: float) -> str:
    """0.01 → "1e-2", 1e-05 → "1e-5" (the metric-key format of ``tasks/evaluate``); a rate that one digit
    cannot hold exactly keeps its repr (0.25 → "0.25"), so two rates never share a key."""
    short = f"{rate:.0e}"
    return short.replace("e-0", "e-") if float(short) == rate else repr(float(rate))


def index_pairs(pairs: np.ndarray, template_ids: np.ndarray) -> np.ndarray:
    """Template-id pairs (P, 2) (e.g. from ``ml.data.ijb_meta.read_template_pairs``) → row indices (P, 2) int64 into
    templates whose ids are ``template_ids`` (G,) (e.g. the ``np.unique`` ids used to build the groups)."""
    pairs = np.asarray(pairs)
    ids = np.asarray(template_ids)
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise DataError(f"pairs must have shape (P, 2) (template id 1, template id 2), got {pairs.shape}")
    if ids.ndim != 1 or np.unique(ids).size != ids.size:
        raise DataError(f"template_ids must be a 1-D array of distinct ids, got shape {ids.shape} with duplicates")
    if ids.size == 0:
        raise DataError("template_ids is empty: there are no templates to index")
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    pos = np.clip(np.searchsorted(sorted_ids, pairs), 0, ids.size - 1)  # (P, 2)
    found = sorted_ids[pos] == pairs
    if not found.all():
        row, col = (int(i) for i in np.argwhere(~found)[0])
        raise DataError(
            f"pair {row} names template {pairs[row, col].item()!r}, which has no template features ({int((~found).sum())} "
            "such ids); drop those pairs or add the templates' images"
        )
    return order[pos].astype(np.int64)


def template_verification(
    templates: np.ndarray,
    pairs: np.ndarray,
    labels: np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
) -> dict[str, float]:
    """IJB 1:1 template verification: TAR at each FAR over the cosine scores of template ``pairs`` (P, 2)
    (row indices into ``templates`` (G, D)) with ``labels`` (P,) 1 = same identity, 0 = different.

    Returns ``"tar@far=1e-4"``-style keys (``ml.eval.metrics.tar_at_far``: threshold = the (k+1)-th highest
    impostor score, k = ⌊FAR·n_impostor⌋) plus ``"n_genuine"`` and ``"n_impostor"``.
    """
    templates = _check_features(templates, "templates")
    pairs = _to_numpy(pairs, "pairs")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.shape[0] == 0 or not np.issubdtype(pairs.dtype, np.integer):
        raise DataError(f"pairs must be integer template indices of shape (P, 2), P ≥ 1, got {pairs.dtype} {pairs.shape}")
    out = np.flatnonzero(((pairs < 0) | (pairs >= templates.shape[0])).any(axis=1))
    if out.size:
        raise DataError(
            f"pair {int(out[0])} = {pairs[out[0]].tolist()} indexes outside the {templates.shape[0]} templates; map "
            "template ids to rows with index_pairs"
        )
    labels = _to_numpy(labels, "labels")
    if labels.shape != (pairs.shape[0],):
        raise DataError(f"labels must have one entry per pair, shape ({pairs.shape[0]},), got {labels.shape}")
    bad = np.flatnonzero(~np.isin(labels, (0, 1)))
    if bad.size:
        raise DataError(f"labels must be 0 or 1, found {labels[bad[0]].item()!r} at pair {int(bad[0])}")
    labels = labels.astype(np.int64)
    n_gen, n_imp = int(labels.sum()), int((labels == 0).sum())
    if n_gen == 0 or n_imp == 0:
        raise DataError(f"verification needs genuine and impostor pairs, got {n_gen} genuine and {n_imp} impostor")
    scores = pair_scores(templates[pairs[:, 0]], templates[pairs[:, 1]])
    result: dict[str, float] = {}
    for far, tar in tar_at_far(scores, labels, fars).items():
        if 0 < far * n_imp < 1:
            log.warning("FAR %s needs at least %d impostor pairs, have %d: reported at observed FAR 0",
                        _fmt_rate(far), int(np.ceil(1 / far)), n_imp)
        result[f"tar@far={_fmt_rate(far)}"] = tar
    result["n_genuine"] = float(n_gen)
    result["n_impostor"] = float(n_imp)
    return result


def video_identification(
    probe_templates: np.ndarray,
    probe_ids: np.ndarray,
    gallery_templates: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    ranks: Sequence[int] = (1, 5),
    fpirs: Sequence[float] = (0.01,),
    mated: np.ndarray | None = None,
) -> dict[str, float]:
    """Probe-set (video) identification against gallery templates: closed-set rank-N over the mated probes
    (``"rank1"``, ``"rank5"``) and open-set TPIR at each FPIR at rank 1 (``"tpir@fpir=1e-2"``) when there are
    non-mated probes, plus ``"n_mated"`` and ``"n_nonmated"``.

    A probe is mated iff its id is among ``gallery_ids``, or as given by ``mated`` (P,) bool: a probe marked
    non-mated counts as an impostor search even if its id is enrolled, and one marked mated must have its id
    in the gallery. Without non-mated probes the TPIR keys are absent (``n_nonmated`` = 0).
    """
    probe_templates = _check_features(probe_templates, "probe_templates")
    gallery_templates = _check_features(gallery_templates, "gallery_templates")
    probe_ids, gallery_ids = np.asarray(probe_ids), np.asarray(gallery_ids)
    p, g = probe_templates.shape[0], gallery_templates.shape[0]
    if probe_ids.shape != (p,) or gallery_ids.shape != (g,):
        raise DataError(
            f"probe_ids must have shape ({p},) and gallery_ids ({g},) (one identity per template), got "
            f"{probe_ids.shape} and {gallery_ids.shape}"
        )
    if probe_templates.shape[1] != gallery_templates.shape[1]:
        raise DataError(
            f"probe and gallery templates differ in dimension: {probe_templates.shape[1]} vs {gallery_templates.shape[1]}"
        )
    identities, gallery_label = np.unique(gallery_ids, return_inverse=True)
    enrolled = np.isin(probe_ids, identities)
    if mated is None:
        mated = enrolled
    else:
        mated = np.asarray(mated)
        if mated.shape != (p,) or mated.dtype != bool:
            raise DataError(f"mated must be a bool array of shape ({p},), got {mated.dtype} {mated.shape}")
        wrong = np.flatnonzero(mated & ~enrolled)
        if wrong.size:
            raise DataError(
                f"probe {int(wrong[0])} is marked mated but its id {_scalar(probe_ids[wrong[0]])!r} is not in the gallery "
                f"({wrong.size} such probes)"
            )
    n_mated = int(mated.sum())
    if n_mated == 0:
        raise DataError("no probe is mated (its identity in the gallery); check that probe and gallery ids match")
    probe_label = np.full(p, -1, dtype=np.int64)  # -1: non-mated, never a gallery label
    probe_label[mated] = np.searchsorted(identities, probe_ids[mated])
    result: dict[str, float] = {}
    closed = identification_rank(probe_templates[mated], probe_label[mated], gallery_templates, gallery_label, ranks)
    for r, rate in closed.items():
        result[f"rank{r}"] = rate
    if n_mated < p:
        open_set = open_set_identification(probe_templates, probe_label, gallery_templates, gallery_label, fpirs, (1,))
        for f in fpirs:
            result[f"tpir@fpir={_fmt_rate(float(f))}"] = open_set[f"tpir@fpir={float(f)!r}/rank1"]
    result["n_mated"] = float(n_mated)
    result["n_nonmated"] = float(p - n_mated)
    return result


def _subsample(groups: _Groups, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted rows keeping min(size, |g|) random images of every group g, without replacement."""
    keys = rng.random(groups.index.size)
    order = np.lexsort((keys, groups.index))  # by group, random inside each
    starts = np.cumsum(groups.counts) - groups.counts
    position = np.arange(order.size) - np.repeat(starts, groups.counts)  # rank inside the group
    return np.sort(order[position < size])


def gain_vs_probe_size(
    features: np.ndarray,
    styles: np.ndarray | None,
    probe_groups: np.ndarray,
    probe_ids: np.ndarray,
    gallery: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    sizes: Sequence[int] = (1, 4, 16, 64, 256),
    methods: Sequence[str] = ("average", "caface"),
    model: CAFace | None = None,
    seed: int = 0,
    landmarks: np.ndarray | None = None,
    face_scores: np.ndarray | None = None,
    image_size: float | None = None,
    chunk_size: int | None = None,
    quality: np.ndarray | None = None,
) -> dict[str, dict[int, float]]:
    """Closed-set rank-1 of probe templates fused from N random frames of each probe, for each N in ``sizes``
    and each fusion method (CAFace Fig. 1c: the gain over averaging grows with the probe size).

    ``features`` (N_img, D) / ``styles`` / ``landmarks`` / ``face_scores`` are per probe image, ``probe_groups``
    (N_img,) ∈ 0..P-1 the probe of each image, ``probe_ids`` (P,) its identity; ``gallery`` (G, D) are gallery
    templates with ``gallery_ids`` (G,). For each size one seeded sub-sample is drawn and shared by all methods.
    Returns ``{method: {size: rank1}}`` and ``{"frames": {size: mean frames used per probe}}`` (probes shorter
    than N keep all their frames).
    """
    feats = _check_features(features)
    grp = _check_groups(probe_groups, feats.shape[0], "probe_groups")
    probe_ids = np.asarray(probe_ids)
    if probe_ids.shape != (grp.num,):
        raise DataError(f"probe_ids must give one identity per probe, shape ({grp.num},), got {probe_ids.shape}")
    absent = np.flatnonzero(~np.isin(probe_ids, np.asarray(gallery_ids)))
    if absent.size:
        raise DataError(
            f"probe {int(absent[0])} (id {_scalar(probe_ids[absent[0]])!r}) is not in the gallery ({absent.size} such "
            "probes); rank-1 is closed-set: drop the non-mated probes"
        )
    sizes = [_positive_int(s, "each probe size") for s in sizes]
    if not sizes:
        raise ConfigError("sizes must list at least one probe size")
    for m in methods:
        if m not in FUSERS:
            raise ConfigError(f"unknown fusion method {m!r}; choose from {', '.join(FUSERS)}")
    rng = np.random.default_rng(seed)
    arrays = {"styles": styles, "landmarks": landmarks, "face_scores": face_scores, "quality": quality}
    arrays = {k: _to_numpy(v, k) for k, v in arrays.items() if v is not None}
    for k, v in arrays.items():
        if v.shape[:1] != (feats.shape[0],):
            raise DataError(f"{k} must have one row per feature ({feats.shape[0]}), got shape {v.shape}")
    result: dict[str, dict[int, float]] = {m: {} for m in methods}
    result["frames"] = {}
    for size in sizes:
        rows = _subsample(grp, size, rng)
        subset = {k: v[rows] for k, v in arrays.items()}
        for m in methods:
            templates = fuse_templates(m, feats[rows], grp.index[rows], model=model, image_size=image_size,
                                       chunk_size=chunk_size, **subset)
            result[m][size] = identification_rank(templates, probe_ids, gallery, gallery_ids, ranks=(1,))[1]
        result["frames"][size] = float(rows.size / grp.num)
    return result


def shuffled_templates(
    model: CAFace,
    features: np.ndarray,
    styles: np.ndarray,
    groups: np.ndarray,
    *,
    shuffles: int = 5,
    chunk_size: int | None = 256,
    seed: int = 0,
    max_items: int = MAX_ITEMS,
) -> np.ndarray:
    """CAFace templates (shuffles, G, D) of the same groups, each time with the images of every group in a new
    random order and streamed in chunks of ``chunk_size``: what changes is only which frames share a chunk."""
    shuffles = _positive_int(shuffles, "shuffles")
    feats = _check_features(features)
    grp = _check_groups(groups, feats.shape[0])
    styles = _to_numpy(styles, "styles")
    if styles.shape[:1] != (feats.shape[0],):
        raise DataError(f"styles must have one row per feature ({feats.shape[0]}), got shape {styles.shape}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(shuffles):
        perm = rng.permutation(feats.shape[0])
        out.append(fuse_templates("caface", feats[perm], grp.index[perm], styles=styles[perm], model=model,
                                  chunk_size=chunk_size, max_items=max_items))
    return np.stack(out)


def order_robustness(
    model: CAFace,
    features: np.ndarray,
    styles: np.ndarray,
    groups: np.ndarray,
    probe_ids: np.ndarray,
    gallery: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    shuffles: int = 5,
    chunk_size: int | None = 256,
    ranks: Sequence[int] = (1, 5),
    fpirs: Sequence[float] = (0.01,),
    mated: np.ndarray | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """CAFace Table 4, last row: ``video_identification`` of the probes fused after ``shuffles`` random frame
    orders (``shuffled_templates``), as ``"<metric>/mean"`` and ``"<metric>/std"`` (sample std, 0 for one
    shuffle), plus ``"template_cosine/min"`` (the lowest cosine between a probe's template under shuffle 0 and
    under any other; 1 = order had no effect) and ``"shuffles"``."""
    templates = shuffled_templates(model, features, styles, groups, shuffles=shuffles, chunk_size=chunk_size,
                                   seed=seed)
    runs = [video_identification(t, probe_ids, gallery, gallery_ids, ranks=ranks, fpirs=fpirs, mated=mated)
            for t in templates]
    result: dict[str, float] = {}
    for key in runs[0]:
        if key.startswith("n_"):
            result[key] = runs[0][key]
            continue
        values = np.array([r[key] for r in runs], dtype=np.float64)
        result[f"{key}/mean"] = float(values.mean())
        result[f"{key}/std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
    cosines = np.einsum("sgd,gd->sg", templates.astype(np.float64), templates[0].astype(np.float64))
    result["template_cosine/min"] = float(cosines.min())
    result["shuffles"] = float(len(runs))
    return result
