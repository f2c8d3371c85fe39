"""The claims experiments' test-set protocol, without torch: which data seeds a verdict may rest on, and the rule
that calls a difference beyond noise with the independent test set as its unit.

A data seed renders its own identities and draws its own pairs or images, so different data seeds are independent
test sets. ``LOOKED_AT`` were in view while recipes and scales were set; ``DATA_SEEDS`` (the experiments' defaults)
were not, so no choice read them. A difference holds beyond noise when, over at least two test sets, its mean
exceeds twice its standard error (sample std / √units) and every test set is on its side; where per-item outcomes
exist (``across_test_sets``) a percentile bootstrap interval over the items must exclude 0 as well. A table of several
claims corrects for their number: each difference carries the two-sided p of a one-sample t-test over its test sets,
and ``holm`` keeps a verdict only where Holm's step-down procedure rejects at α = 0.05 across the table.

A test set is independent of the default run only if it shares no face with it: ``shared_faces`` renders the
identities of both (``tasks.prepare.procedural_identities`` for the run) and compares them, parameters and pixels.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np

__all__ = ["DATA_SEEDS", "LOOKED_AT", "across_test_sets", "corrected", "holm", "now_utc", "over_test_sets", "shared_faces"]

LOOKED_AT = (0, 1)  # the data seeds in view while the recipes and the scales were set: never a verdict's test set
DATA_SEEDS = (2, 3, 4, 5, 6)  # independent test sets none of the recipes was chosen on


def now_utc() -> str:
    """A report's clock, to the minute (stored with the results, so re-rendering keeps when they were measured)."""
    return f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}"


def over_test_sets(diffs: list[float] | np.ndarray) -> dict[str, Any]:
    """One difference per independent test set as the units: ``mean`` ± sample ``std``, ``se`` (None under 2
    units), ``units``, how many were ``higher``; ``beyond_noise`` at ≥ 2 units with the mean beyond 2 SE and every
    unit on its side."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    std = float(d.std(ddof=1)) if n > 1 else 0.0
    se = std / np.sqrt(n) if n > 1 else None
    mean = float(d.mean())
    beyond = bool(se is not None and abs(mean) > 2 * se and (np.sign(d) == np.sign(mean)).all())
    return {"mean": mean, "std": std, "se": se, "units": n, "higher": int((d > 0).sum()), "beyond_noise": beyond,
            "p": _t_test_p(mean, se, n)}


def _t_test_p(mean: float, se: float | None, n: int) -> float | None:
    """Two-sided p of a one-sample t-test of mean 0 over ``n`` units (None under 2 units; 0 or 1 at se = 0)."""
    if se is None:
        return None
    if se == 0:
        return 1.0 if mean == 0 else 0.0
    from scipy.stats import t

    return float(2 * t.sf(abs(mean) / se, n - 1))


def holm(p_values: list[float | None], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure over one table's claims: the i-th smallest p (1-based) is rejected while every
    smaller one was and it is ≤ α / (m − i + 1); m counts every claim, a missing p (under 2 units) is never rejected.
    → per claim, whether its null is rejected at family-wise error ``alpha``."""
    m = len(p_values)
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    rejected = [False] * m
    for rank, (p, i) in enumerate(order):
        if p > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def corrected(diffs: list[dict[str, Any] | None], alpha: float = 0.05) -> list[bool]:
    """``holm`` over one table's differences (``over_test_sets`` / ``across_test_sets`` results; None for a row
    without one, which counts in m as a difference never rejected). A result stored before p was recorded gets it
    from its mean, se and units. → per row, whether its null is rejected."""
    return holm([None if d is None else d.get("p", _t_test_p(d["mean"], d.get("se"), d["units"])) for d in diffs],
                alpha)


def shared_faces(test_sets: dict[str, tuple[int, range]], rendered: dict[str, tuple[int, range]],
                 image_size: int = 32) -> list[str]:
    """Where a test set shares faces with a rendered set: ``test_sets`` and ``rendered`` map a name to (procedural
    seed, identities). Both are rendered: an identity is shared when its parameters equal one of the other side's, an
    image when the first face of an identity (at ``image_size``, the default nuisances) has the same bytes. → one
    line per (test set, rendered set) pair that shares any, naming the counts; [] when every test set is disjoint."""
    import hashlib

    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    gens: dict[int, ProceduralFaces] = {}

    def faces(seed: int, ids: range) -> tuple[set, set]:
        gen = gens.setdefault(seed, ProceduralFaces(ProceduralConfig(image_size=image_size), seed=seed))
        params = {tuple(sorted(gen.identity(i).items())) for i in ids}
        images = {hashlib.sha256(gen.sample(i, 0).image.tobytes()).hexdigest() for i in ids}
        return params, images

    theirs = {name: faces(seed, ids) for name, (seed, ids) in rendered.items()}
    found = []
    for name, (seed, ids) in test_sets.items():
        params, images = faces(seed, ids)
        for other, (p, im) in theirs.items():
            if params & p or images & im:
                found.append(f"{name} (seed {seed}, identities {ids.start}–{ids.stop - 1}) shares {len(params & p)} "
                             f"identities and {len(images & im)} images with {other}")
    return found


def across_test_sets(arm: list[np.ndarray], reference: list[np.ndarray], data_of: list[int], *,
                     identities: list[np.ndarray] | None = None, resamples: int = 2000, seed: int = 0,
                     confidence: float = 0.95) -> dict[str, Any]:
    """``arm − reference`` with the data seed, an independent test set, as the unit.

    ``arm`` / ``reference``: each run's per-item outcomes (e.g. ``pair_correct``; the same items for both arms
    within a data seed), ``data_of``: each run's data seed. Per data seed the runs' outcomes are averaged over its
    training seeds, so a data seed's difference is its mean accuracy difference. → ``over_test_sets`` of those
    differences, plus ``ci_low`` / ``ci_high``: a percentile bootstrap interval over the items (resampled within
    each data seed, one draw for both arms; the statistic is the mean over data seeds); ``beyond_noise`` also needs
    the interval to exclude 0. With ``identities`` (each run's identity per item, the same within a data seed) the
    bootstrap draws identities instead, with every item of a drawn identity: items of one identity are not
    independent, so this interval is the honest one (``resampled`` says which it was)."""
    diffs, groups = [], []
    for d in sorted(set(data_of)):
        rows = [i for i, dd in enumerate(data_of) if dd == d]
        diffs.append(np.mean([arm[i].astype(np.float64) - reference[i].astype(np.float64) for i in rows], axis=0))
        groups.append(None if identities is None else np.unique(identities[rows[0]], return_inverse=True)[1])
    units = over_test_sets([x.mean() for x in diffs])
    rng = np.random.default_rng(seed)
    boot = np.zeros(resamples)
    for x, g in zip(diffs, groups):
        if g is None:
            boot += x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1) / len(diffs)
            continue
        # per identity: its items' sum and count; a draw of identities sums both, then divides
        sums, counts = np.bincount(g, weights=x), np.bincount(g).astype(np.float64)
        drawn = rng.integers(0, len(sums), size=(resamples, len(sums)))
        boot += sums[drawn].sum(axis=1) / counts[drawn].sum(axis=1) / len(diffs)
    tail = 100 * (1 - confidence) / 2
    low, high = float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))
    beyond = units["beyond_noise"] and (low > 0 or high < 0)
    return {**units, "ci_low": low, "ci_high": high, "beyond_noise": beyond,
            "resampled": "items" if identities is None else "identities"}
