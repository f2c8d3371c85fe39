"""Semi-supervised k-means (SSK): GCD's inference (Vaze et al. 2022, §3.2), run by FaceGCD with n_init 10, max_iter 500.

Features x (N, D), a labelled subset with classes y, K clusters: the n_known labelled classes (sorted) are clusters
0..n_known − 1 and their labelled points never move; their centroids start at the labelled class means, the other
K − n_known are k-means++ draws over the unlabelled points (the known centroids count as chosen). Lloyd iterations
move each unlabelled point to ``argmin_j ‖x − c_j‖²`` and average all members; a restart stops after ``max_iter``, when
no assignment changed, or when ``Σ_j ‖Δc_j‖² ≤ tol · mean_d Var(x_d)``; the lowest-inertia of ``n_init`` restarts is
kept. Distances ``‖x‖² − 2x·c + ‖c‖²`` go in (batch_size, K) blocks, never (N, K, D). Deterministic on the CPU; on
CUDA ``index_add_`` may change the centroids' last bits.

Differences from the reference (GCD's ``K_Means.fit_mix``): an empty (novel) cluster keeps its centroid (there: NaN);
the stop is sklearn's relative test on Σ‖Δc‖² plus a no-change test (there: (Σ‖Δc‖)² < tol, absolute); the result
is the last iteration's assignment (there: a restart's lowest-inertia iteration); k-means++ keeps a running minimum
distance (same sampling; uniform when all d = 0) and draws from at most ``init_pool`` unlabelled points per restart
(there: all); features are clustered as given (GCD L2-normalises them first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ml.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BATCH_SIZE", "SSKResult", "semi_supervised_kmeans"]

DEFAULT_BATCH_SIZE = 8192  # points per distance block: (8192, K) float32 = 32 MiB at K = 1000


@dataclass(frozen=True, eq=False)
class SSKResult:
    """Outcome of the kept run.

    labels: (N,) int64 cluster of each point, in input order.
    centroids: (K, D) float32.
    inertia: sum_i ||x_i - c_{labels_i}||^2 over all points.
    n_iter: centroid updates made by the kept run.
    known_classes: (n_known,) the sorted labelled classes; cluster j < n_known is class known_classes[j].
    """

    labels: np.ndarray
    centroids: np.ndarray
    inertia: float
    n_iter: int
    known_classes: np.ndarray


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _features_tensor(features: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(N, D) float32 tensor of finite values, else DataError naming the first bad row."""
    x = features.detach() if isinstance(features, torch.Tensor) else torch.as_tensor(np.asarray(features))
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"features must be a non-empty 2-D (N, D) array; got shape {tuple(x.shape)}")
    if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)):
        raise DataError(f"features must be real numbers; got dtype {x.dtype}")
    x = x.to(torch.float32)
    finite = torch.isfinite(x).all(dim=1)  # (N,)
    if not bool(finite.all()):
        bad = int(torch.nonzero(~finite)[0, 0])
        raise DataError(f"features has NaN/inf (first at row {bad}); check the model output before clustering")
    return x


def _labels_and_mask(labels: object, labelled_mask: object, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(N,) integer labels and (N,) bool mask with >= 1 labelled point and non-negative labelled classes."""
    labels = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    mask = labelled_mask.cpu().numpy() if isinstance(labelled_mask, torch.Tensor) else np.asarray(labelled_mask)
    for name, arr in (("labels", labels), ("labelled_mask", mask)):
        if arr.ndim != 1 or arr.shape[0] != n:
            raise DataError(f"{name} must be a 1-D array with one entry per feature row ({n}); got shape {arr.shape}")
    if mask.dtype != bool:
        raise DataError(f"labelled_mask must be boolean (True = labelled); got dtype {mask.dtype}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"labels must be integer class ids; got dtype {labels.dtype} - give unlabelled points any integer, e.g. -1"
        )
    if not mask.any():
        raise DataError(
            "labelled_mask selects no point: semi-supervised k-means needs labelled points to fix the known "
            "clusters; without labels use plain k-means (ml.discovery.baselines.kmeans_baseline)"
        )
    negative = np.flatnonzero(mask & (labels < 0))
    if negative.size:
        raise DataError(
            f"labels has {negative.size} negative class id(s) among labelled points (first at index "
            f"{int(negative[0])}: {int(labels[negative[0]])}); labelled classes must be >= 0 - "
            "mark those points unlabelled or fix their labels"
        )
    return labels, mask


# --------------------------------------------------------------------------------------------
# distances, k-means++
# --------------------------------------------------------------------------------------------


def _nearest(
    x: torch.Tensor, x2: torch.Tensor, centroids: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared distance to, and index of, the nearest centroid: ((M,), (M,) int64); ties go to the lower index.

    ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2, one (B, K) block per ``batch_size`` rows of x (M, D).
    """
    c2 = (centroids * centroids).sum(dim=1)  # (K,)
    ct = centroids.T.contiguous()  # (D, K)
    dist = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    index = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for lo in range(0, x.shape[0], batch_size):
        block = torch.addmm(c2, x[lo : lo + batch_size], ct, alpha=-2.0)  # (B, K) = ||c||^2 - 2 x.c
        best, arg = block.min(dim=1)
        dist[lo : lo + batch_size] = best + x2[lo : lo + batch_size]
        index[lo : lo + batch_size] = arg
    return dist.clamp_min_(0.0), index


def _kmeans_pp_init(
    x: torch.Tensor, x2: torch.Tensor, chosen: torch.Tensor, n_new: int, rng: np.random.Generator, batch_size: int
) -> torch.Tensor:
    """``n_new`` k-means++ centroids (n_new, D) drawn from the rows of x (M, D), ``chosen`` (C, D) already taken.

    Each draw picks row u with probability d_u^2 / sum_v d_v^2, d_u = distance from x_u to its nearest
    centroid so far (uniformly if all d_u are 0); d is kept as a running minimum, one pass per draw.
    """
    if n_new == 0:
        return x.new_empty((0, x.shape[1]))
    d2 = _nearest(x, x2, chosen, batch_size)[0]  # (M,) float32, running min over chosen centroids
    picks: list[int] = []
    for _ in range(n_new):
        # the draw runs in numpy (float64, one thread): few torch calls per draw, the pass over x dominates
        weights = np.maximum(d2.cpu().numpy().astype(np.float64), 0.0)  # (M,)
        weights[picks] = 0.0  # exactly 0 for chosen rows, whatever the float32 rounding of ||x_u - x_u||^2
        cum = np.cumsum(weights)
        if cum[-1] > 0.0:
            # first u with cum_u > r: its own weight is > 0, so a zero-distance point is never drawn
            u = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), x.shape[0] - 1)
        else:
            u = int(rng.integers(x.shape[0]))
        picks.append(u)
        c = x[u]  # (D,)
        d_new = torch.addmv(x2, x, c, alpha=-2.0)  # (M,) ||x||^2 - 2 x.c: one pass over x
        torch.minimum(d2, d_new.add_(c.dot(c)), out=d2)
    return x[torch.tensor(picks, device=x.device)]


# --------------------------------------------------------------------------------------------
# semi-supervised k-means
# --------------------------------------------------------------------------------------------


def semi_supervised_kmeans(
    features: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    labelled_mask: np.ndarray | torch.Tensor,
    k: int,
    *,
    n_init: int = 10,
    max_iter: int = 500,
    tol: float = 1e-4,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device | None = None,
    init_pool: int = 20_000,
) -> SSKResult:
    """Semi-supervised k-means: labelled points fixed to their class cluster, the rest by Lloyd (see module doc).

    Args:
        features: (N, D) features; cast to float32. GCD L2-normalises them first.
        labels: (N,) integer classes; only entries where ``labelled_mask`` is True are read.
        labelled_mask: (N,) bool, True for labelled points (at least one).
        k: number of clusters, >= the number of distinct labelled classes.
        n_init: restarts with different k-means++ draws (restart i seeds ``np.random.default_rng([seed, i])``).
        max_iter: most centroid updates per restart.
        tol: relative centroid-shift tolerance (times the mean per-dimension feature variance).
        seed: non-negative integer seed.
        batch_size: points per distance block.
        device: torch device to compute on; default: the device of a tensor ``features``, else CPU.
        init_pool: k-means++ draws its novel centroids from a random subset of at most this many
            unlabelled points (redrawn per restart; 0 = all). Seeding costs one pass over the pool per
            novel centroid, so at 100k points and K = 1000 the full set dominates the run time.

    Returns:
        The lowest-inertia restart (the first on ties).
    """
    x = _features_tensor(features)
    n = x.shape[0]
    labels, mask = _labels_and_mask(labels, labelled_mask, n)
    k = _positive_int(k, "k")
    n_init = _positive_int(n_init, "n_init")
    if isinstance(init_pool, bool) or not isinstance(init_pool, (int, np.integer)) or init_pool < 0:
        raise ConfigError(f"init_pool must be an integer ≥ 0 (0 = every unlabelled point), got {init_pool!r}")
    max_iter = _positive_int(max_iter, "max_iter")
    batch_size = _positive_int(batch_size, "batch_size")
    seed = _positive_int(seed, "seed", minimum=0)
    if not (isinstance(tol, (int, float, np.floating)) and np.isfinite(tol) and tol >= 0):
        raise ConfigError(f"tol must be a finite number >= 0; got {tol!r}")

    known_classes, known_cluster = np.unique(labels[mask], return_inverse=True)  # sorted; (L,) in 0..n_known-1
    n_known = known_classes.size
    if k < n_known:
        raise ConfigError(
            f"k={k} is smaller than the {n_known} known classes among the labelled points; each known class "
            f"needs its own cluster, so set k >= {n_known} (k = known + novel classes)"
        )
    n_unlabelled = int(n - mask.sum())
    if n_unlabelled < k - n_known:
        raise DataError(
            f"only {n_unlabelled} unlabelled point(s) to seed the {k - n_known} novel cluster(s) "
            f"(k={k} minus {n_known} known classes); lower k or add unlabelled points"
        )

    dev = torch.device(device) if device is not None else x.device
    x = x.to(dev)
    x_l = x[torch.from_numpy(np.flatnonzero(mask)).to(dev)]  # (L, D)
    x_u = x[torch.from_numpy(np.flatnonzero(~mask)).to(dev)]  # (U, D)
    x2_u = (x_u * x_u).sum(dim=1)  # (U,)
    tol_abs = float(tol) * float(x.var(dim=0, unbiased=False).mean())
    del x

    # labelled members never move: their per-cluster sums, counts and sum of squares are constants
    y_l = torch.from_numpy(known_cluster.astype(np.int64)).to(dev)  # (L,)
    x_l64 = x_l.to(torch.float64)
    sum_l = torch.zeros(k, x_l.shape[1], dtype=torch.float64, device=dev).index_add_(0, y_l, x_l64)  # (K, D)
    count_l = torch.bincount(y_l, minlength=k).to(torch.float64)  # (K,)
    sq_l = float((x_l64 * x_l64).sum())
    del x_l64
    known_means = (sum_l[:n_known] / count_l[:n_known, None]).to(torch.float32)  # (n_known, D)

    def labelled_inertia(c: torch.Tensor) -> float:
        # sum_{i in L} ||x_i - c_{y_i}||^2 = sum ||x_i||^2 - 2 sum_j c_j.S_j + sum_j n_j ||c_j||^2
        c64 = c.to(torch.float64)
        return sq_l - 2.0 * float((c64 * sum_l).sum()) + float((count_l * (c64 * c64).sum(dim=1)).sum())

    best: tuple[float, torch.Tensor, torch.Tensor, int] | None = None
    for restart in range(n_init):
        rng = np.random.default_rng([seed, restart])
        pool: slice | torch.Tensor = slice(None)
        pool_size = max(init_pool, 4 * (k - n_known))  # never fewer candidates than the draws need
        if init_pool > 0 and pool_size < x_u.shape[0]:
            pool = torch.from_numpy(np.sort(rng.choice(x_u.shape[0], pool_size, replace=False))).to(x_u.device)
        novel = _kmeans_pp_init(x_u[pool], x2_u[pool], known_means, k - n_known, rng, batch_size)
        centroids = torch.cat([known_means, novel])  # (K, D)
        dist, assign = _nearest(x_u, x2_u, centroids, batch_size)  # (U,), (U,)
        n_iter = 0
        while n_iter < max_iter:
            n_iter += 1
            sums = torch.zeros_like(centroids).index_add_(0, assign, x_u)  # (K, D) unlabelled part
            counts = count_l + torch.bincount(assign, minlength=k).to(torch.float64)  # (K,)
            means = ((sum_l + sums.to(torch.float64)) / counts.clamp_min(1.0)[:, None]).to(torch.float32)
            updated = torch.where((counts > 0)[:, None], means, centroids)  # empty cluster: keep its centroid
            shift = float(((updated - centroids) ** 2).sum())
            centroids = updated
            dist, new_assign = _nearest(x_u, x2_u, centroids, batch_size)
            changed = int((new_assign != assign).sum())
            assign = new_assign
            if changed == 0 or shift <= tol_abs:
                break
        inertia = float(dist.to(torch.float64).sum()) + labelled_inertia(centroids)
        logger.debug("SSK restart %d: inertia %.6g after %d iteration(s)", restart, inertia, n_iter)
        if best is None or inertia < best[0]:
            best = (inertia, centroids, assign, n_iter)

    assert best is not None
    inertia, centroids, assign, n_iter = best
    out = np.empty(n, dtype=np.int64)
    out[mask] = known_cluster
    out[~mask] = assign.cpu().numpy()
    return SSKResult(
        labels=out,
        centroids=centroids.cpu().numpy(),
        inertia=inertia,
        n_iter=n_iter,
        known_classes=known_classes,
    )
