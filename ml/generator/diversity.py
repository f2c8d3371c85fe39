"""Identity consistency and diversity of a synthetic face dataset (UIFace Table 2): embeddings in, numbers out.

- ``identity_consistency``: mean intra-class cosine under the FR model (the genuine similarity of UIFace Fig. 5).
- ``embedding_diversity``: mean intra-class cosine distance (1 − IC), a proxy for Table 2's intra-class LPIPS.
- ``inter_class_separation`` (class-centre cosines) and ``identity_gap`` (intra − pairwise inter-class cosine).
- ``nearest_real``: the privacy check, synthetic identities and faces against real training ones.
- ``improved_precision_recall``: Kynkäänniemi et al., NeurIPS 2019 (UIFace reports the recall, k = 10).
- ``frechet_distance``: FID's distance between feature distributions, in a feature space the caller picks.
- ``diversity_report``: the above as flat ``synthetic/...`` metric names. Image-space measures: ``image_diversity``.

Differences from the reference:
- UIFace: Improved Recall on Inception embeddings of 10k × 50 images, LPIPS with a VGG on 100 identities; here P/R
  run on the embeddings given (the unit FR embeddings in ``diversity_report``) and diversity is the embedding
  proxy: no Inception or VGG weights offline.
- P/R as the reference code (kynkaat, ``precision_recall.py``, ``ManifoldEstimator``): inside a ball iff the squared
  distance ≤ the squared radius; float64 blocks of a memory budget (reference: float32/16 blocks of fixed size);
  the optional pruning of outlier radii is omitted.
"""

from __future__ import annotations

import numpy as np
import torch

from ml.errors import ConfigError, DataError

__all__ = [
    "diversity_report",
    "embedding_diversity",
    "identity_consistency",
    "identity_gap",
    "improved_precision_recall",
    "inter_class_separation",
    "nearest_real",
    "per_class_consistency",
]


# Elements of one (rows, N) distance block: 2**24 float64 = 128 MiB, i.e. 838 rows at a time against
# 20k samples; a partition copy and a bool mask of the same shape come on top.
_BATCH_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _as_embeddings(x, name: str) -> np.ndarray:
    """``x`` as a finite float64 (N, D) array with N, D >= 1, else DataError naming it."""
    x = _to_numpy(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"{name} must be a non-empty (N, D) array of embeddings; got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{name} must hold numbers; got dtype {x.dtype}")
    x = x.astype(np.float64, copy=False)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise DataError(
            f"{name} has {bad.size} row(s) with NaN or inf (first at row {int(bad[0])}); "
            "check the FR model output for those images"
        )
    return x


def _as_labels(labels, n: int, name: str = "labels") -> np.ndarray:
    labels = _to_numpy(labels)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise DataError(f"{name} must be a 1-D array with one entry per embedding ({n}); got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{name} must hold integer class ids; got dtype {labels.dtype}")
    return labels


def _unit_rows(x: np.ndarray, name: str) -> np.ndarray:
    """Rows scaled to unit L2 norm; a zero row has no direction and raises."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # (N, 1)
    zero = np.flatnonzero(norms[:, 0] == 0)
    if zero.size:
        raise DataError(
            f"{name} has {zero.size} all-zero row(s) (first at row {int(zero[0])}); "
            "a zero embedding has no direction, so its cosine similarity is undefined"
        )
    return x / norms


def _grouped(emb, labels) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(class ids (C,), counts (C,), sums of unit embeddings (C, D), sums of their squared norms (C,))."""
    emb = _as_embeddings(emb, "emb")
    labels = _as_labels(labels, emb.shape[0])
    unit = _unit_rows(emb, "emb")
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sums = np.add.reduceat(unit[order], starts, axis=0)  # (C, D)
    sq_norms = np.add.reduceat(np.einsum("nd,nd->n", unit, unit)[order], starts)  # (C,), each ~ count
    return classes, counts, sums, sq_norms


def _per_class_mean_cos(emb, labels) -> np.ndarray:
    """Mean cosine over the n(n-1)/2 pairs i < j of each class, (C,); every class needs n >= 2.

    sum_{i<j} u_i.u_j = (||sum_i u_i||^2 - sum_i ||u_i||^2) / 2, so no pair is formed explicitly.
    """
    classes, counts, sums, sq_norms = _grouped(emb, labels)
    small = np.flatnonzero(counts < 2)
    if small.size:
        raise DataError(
            f"class {classes[small[0]].item()!r} has {counts[small[0]]} embedding(s) but intra-class "
            f"similarity needs at least 2 per class ({small.size} class(es) are below that, e.g. "
            f"{classes[small[:5]].tolist()}); drop those classes or generate more images for them"
        )
    pair_sums = (np.einsum("cd,cd->c", sums, sums) - sq_norms) / 2.0
    return pair_sums / (counts * (counts - 1) / 2.0)


# --------------------------------------------------------------------------------------------
# identity consistency and diversity
# --------------------------------------------------------------------------------------------


def per_class_consistency(emb, labels) -> dict[int, float]:
    """{class: mean pairwise cosine within it} (embeddings L2-normalised here); every class needs ≥ 2 rows."""
    classes = np.unique(_as_labels(labels, _as_embeddings(emb, "emb").shape[0]))
    return {int(c): float(v) for c, v in zip(classes, _per_class_mean_cos(emb, labels))}


def identity_consistency(emb, labels) -> float:
    """Mean intra-class cosine similarity, averaged per class first, then over classes.

        IC = (1/C) sum_c [ 2 / (n_c (n_c - 1)) sum_{i<j in c} cos(e_i, e_j) ]

    Embeddings are L2-normalised first. Every class weighs the same whatever its size (a macro
    average), so one identity with many images cannot dominate. Higher = the FR model sees the
    images of an identity as the same person (UIFace's "intra-class similarity", Fig. 2 and 5).

    Args:
        emb: (N, D) embeddings, e.g. (N, 512) from the FR model; rows non-zero.
        labels: (N,) integer identity of each embedding; every identity needs >= 2 embeddings.

    Returns:
        IC in [-1, 1].
    """
    return float(np.mean(_per_class_mean_cos(emb, labels)))


def embedding_diversity(emb, labels) -> float:
    """Intra-class diversity: mean pairwise cosine distance (1 - cos) within each class, then over classes.

        DIV = (1/C) sum_c [ 2 / (n_c (n_c - 1)) sum_{i<j in c} (1 - cos(e_i, e_j)) ] = 1 - IC

    An embedding-space proxy for the intra-class LPIPS of UIFace Table 2: LPIPS needs VGG16 and
    LPIPS linear-layer weights, which are not available offline (see ``lpips_distance`` to use
    them when a local weights file exists). FR embeddings are trained to ignore pose, expression
    and light, so this proxy under-reports the image-space variation LPIPS sees; compare it only
    between sets embedded by the same FR model. Same averaging as ``identity_consistency``.

    Args:
        emb: (N, D) embeddings; rows non-zero.
        labels: (N,) integer identity; every identity needs >= 2 embeddings.

    Returns:
        DIV in [0, 2]; higher = more varied images per identity.
    """
    return float(np.mean(1.0 - _per_class_mean_cos(emb, labels)))


def inter_class_separation(emb, labels) -> dict[str, float]:
    """Cosine similarity between class centres: mean and max over all pairs of distinct classes.

    The centre of class c is the normalised mean of its L2-normalised embeddings,
    m_c = sum_{i in c} u_i / ||sum_{i in c} u_i||. Over the C(C-1)/2 pairs a < b:

        mean_cos = 2 / (C (C - 1)) sum_{a<b} m_a.m_b,     max_cos = max_{a<b} m_a.m_b

    Lower = more distinct identities; ``max_cos`` is the closest pair of identities (compare it with
    the ``max_cosine`` bound of ``ml.generator.contexts.select_identity_contexts``). A class of one embedding is
    allowed (its centre is that embedding). The max is computed in blocks of centres, so 10k
    identities never hold a 10k x 10k matrix.

    Args:
        emb: (N, D) embeddings; rows non-zero.
        labels: (N,) integer identity; at least 2 identities.

    Returns:
        ``{"mean_cos": ..., "max_cos": ...}``, each in [-1, 1].
    """
    classes, counts, sums, _ = _grouped(emb, labels)
    c = classes.size
    if c < 2:
        raise DataError(f"inter-class separation needs at least 2 classes; labels hold only {classes.tolist()}")
    norms = np.linalg.norm(sums, axis=1)
    zero = np.flatnonzero(norms <= 1e-12 * counts)
    if zero.size:
        raise DataError(
            f"class {classes[zero[0]].item()!r} has embeddings that cancel out (their mean is ~0), so its centre "
            "has no direction; check that class's embeddings"
        )
    centres = sums / norms[:, None]  # (C, D) unit
    total = centres.sum(axis=0)
    mean_cos = (total @ total - np.einsum("cd,cd->", centres, centres)) / (c * (c - 1))

    max_cos = -np.inf
    batch = max(1, _BATCH_ELEMENTS // c)
    for lo in range(0, c - 1, batch):
        block = centres[lo : lo + batch] @ centres.T  # (B, C)
        rows = np.arange(block.shape[0])
        upper = np.arange(c)[None, :] > (lo + rows)[:, None]  # pairs a < b only
        max_cos = max(max_cos, float(block[upper].max()))
    return {"mean_cos": float(mean_cos), "max_cos": max_cos}


def identity_gap(emb, labels) -> dict[str, float]:
    """Identity gap: mean intra-class cosine − mean pairwise inter-class cosine, over face pairs.

    With u_i the L2-normalised embeddings, s_c = sum_{i in c} u_i, n_c the class sizes, N = sum n_c::

        intra = mean_c (||s_c||² − n_c) / (n_c (n_c − 1))                        (the identity consistency)
        inter = (||sum_c s_c||² − sum_c ||s_c||²) / (N² − sum_c n_c²)             (every pair of faces of two classes)
        gap   = intra − inter

    Unlike the centre-to-centre separation, ``inter`` is on the scale of ``intra``: faces of one identity must be
    more alike than faces of two for the gap to be positive (real faces under a trained FR model: ≈ 0.6; faces
    that ignore their identity context: ≈ 0). Every class needs ≥ 2 embeddings; ≥ 2 classes.
    """
    classes, counts, sums, _ = _grouped(emb, labels)
    if classes.size < 2:
        raise DataError(f"the identity gap needs at least 2 classes; labels hold only {classes.tolist()}")
    if counts.min() < 2:
        raise DataError(f"class {classes[np.argmin(counts)].item()!r} has one embedding; the identity gap needs "
                        "≥ 2 per class")
    sq = np.einsum("cd,cd->c", sums, sums)
    intra = float(np.mean((sq - counts) / (counts * (counts - 1.0))))
    total = sums.sum(axis=0)
    n = counts.sum()
    inter = float((total @ total - sq.sum()) / (n * n - np.sum(counts.astype(np.float64) ** 2)))
    return {"intra": intra, "inter": inter, "gap": intra - inter}


def nearest_real(emb, labels, real_emb, real_labels) -> dict[str, np.ndarray]:
    """Privacy check: how close synthetic identities and faces come to real (training) ones under the FR model.

    Returns ``identity_max_cos`` (per synthetic class, in ``np.unique(labels)`` order: the highest cosine between
    its centre and any real class centre), ``identity_nearest`` (that real class), ``face_max_cos`` (per synthetic
    face: its highest cosine to any real face, a memorisation check) and ``face_nearest`` (that real face's row).
    Centres are normalised means of normalised embeddings."""
    fake = _unit_rows(_as_embeddings(emb, "emb"), "emb")
    real = _unit_rows(_as_embeddings(real_emb, "real_emb"), "real_emb")
    if fake.shape[1] != real.shape[1]:
        raise DataError(f"emb has {fake.shape[1]} dimensions but real_emb {real.shape[1]}: embed both with one model")
    _, _, fake_sums, _ = _grouped(fake, labels)
    real_classes, _, real_sums, _ = _grouped(real, real_labels)
    fc = fake_sums / np.linalg.norm(fake_sums, axis=1, keepdims=True).clip(1e-12)
    rc = real_sums / np.linalg.norm(real_sums, axis=1, keepdims=True).clip(1e-12)
    centre_sim = fc @ rc.T  # (C_fake, C_real)
    face_max, face_arg = np.empty(len(fake)), np.empty(len(fake), np.int64)
    batch = max(1, _BATCH_ELEMENTS // max(1, len(real)))
    for lo in range(0, len(fake), batch):
        block = fake[lo : lo + batch] @ real.T
        face_arg[lo : lo + batch] = block.argmax(axis=1)
        face_max[lo : lo + batch] = block.max(axis=1)
    return {"identity_max_cos": centre_sim.max(axis=1), "identity_nearest": real_classes[centre_sim.argmax(axis=1)],
            "face_max_cos": face_max, "face_nearest": face_arg}


# --------------------------------------------------------------------------------------------
# improved precision and recall
# --------------------------------------------------------------------------------------------


def _check_batch(batch_size: int | None, n_cols: int) -> int:
    if batch_size is None:
        return max(1, _BATCH_ELEMENTS // n_cols)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ConfigError(
            f"batch_size must be a positive integer (rows per distance block) or None; got {batch_size!r}"
        )
    return int(batch_size)


def _sq_dist_block(a: np.ndarray, a_sq: np.ndarray, b: np.ndarray, b_sq: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances ||a_i - b_j||^2, (A, B), clipped at 0 against rounding."""
    d = a @ b.T  # (A, B)
    d *= -2.0
    d += a_sq[:, None]
    d += b_sq[None, :]
    return np.maximum(d, 0.0, out=d)


def _knn_radii_sq(x: np.ndarray, x_sq: np.ndarray, k: int, batch: int) -> np.ndarray:
    """Squared distance from each row to its k-th nearest *other* row, (N,)."""
    n = x.shape[0]
    radii = np.empty(n)
    for lo in range(0, n, batch):
        d = _sq_dist_block(x[lo : lo + batch], x_sq[lo : lo + batch], x, x_sq)  # (B, N)
        rows = np.arange(d.shape[0])
        d[rows, lo + rows] = np.inf  # a sample is not its own neighbour
        radii[lo : lo + d.shape[0]] = np.partition(d, k - 1, axis=1)[:, k - 1]
    return radii


def _inside_balls(
    fake: np.ndarray, fake_sq: np.ndarray, fake_r: np.ndarray,
    real: np.ndarray, real_sq: np.ndarray, real_r: np.ndarray, batch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One pass over the (N_f, N_r) cross distances, in fake-row blocks: (fake sample i inside some real
    ball (N_f,), real sample j inside some fake ball (N_r,)), a ball being ||x - centre|| <= radius."""
    fake_in = np.empty(fake.shape[0], dtype=bool)
    real_in = np.zeros(real.shape[0], dtype=bool)
    for lo in range(0, fake.shape[0], batch):
        hi = min(lo + batch, fake.shape[0])
        d = _sq_dist_block(fake[lo:hi], fake_sq[lo:hi], real, real_sq)  # (B, N_r)
        fake_in[lo:hi] = (d <= real_r[None, :]).any(axis=1)  # rows: fakes in the real manifold
        real_in |= (d <= fake_r[lo:hi, None]).any(axis=0)  # columns: reals in these fakes' balls
    return fake_in, real_in


def improved_precision_recall(real, fake, k: int = 10, batch_size: int | None = None) -> dict[str, float]:
    """Improved precision and recall of a generated set against a real one (Kynkäänniemi et al. 2019).

    Each set's manifold is the union of balls around its samples, the radius of a sample being the
    Euclidean distance to its k-th nearest *other* sample of the same set:

        manifold(S) = U_{s in S} B(s, ||s - NN_k(s, S \\ {s})||)
        precision = |{f in fake : f in manifold(real)}| / |fake|   (fidelity)
        recall    = |{r in real : r in manifold(fake)}| / |real|   (coverage; UIFace's "ImRecall")

    A point at exactly the radius is inside (<=, as the reference code). Distances are computed on
    the embeddings as given (``diversity_report`` passes L2-normalised ones), in float64, in row
    blocks of ``batch_size`` rows against a whole set, so 20k x 20k never builds a 20k^2 matrix; the
    result does not depend on ``batch_size``. Cost: three passes of distance blocks (real x real,
    fake x fake, and fake x real shared by precision and recall), ~ (N_r + N_f)^2 x D multiply-adds.

    Source: Kynkäänniemi et al., NeurIPS 2019, Sec. 2 (Eq. 1-2) and ``precision_recall.py``.

    Args:
        real: (N_r, D) embeddings of real images.
        fake: (N_f, D) embeddings of generated images, same D.
        k: neighbour rank defining the radii; 1 <= k < min(N_r, N_f). UIFace uses 10.
        batch_size: rows per distance block; None picks about 2**24 / max(N_r, N_f) rows (128 MiB).

    Returns:
        ``{"precision": p, "recall": r}``, each in [0, 1].
    """
    real = _as_embeddings(real, "real")
    fake = _as_embeddings(fake, "fake")
    if real.shape[1] != fake.shape[1]:
        raise DataError(f"real and fake embeddings differ in dimension: {real.shape[1]} vs {fake.shape[1]}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k must be a positive integer (the neighbour rank of the radii); got {k!r}")
    k = int(k)
    for name, x in (("real", real), ("fake", fake)):
        if k >= x.shape[0]:
            raise DataError(
                f"k={k} needs more than k samples in each set, but {name} has {x.shape[0]}; "
                f"lower k or pass more {name} embeddings"
            )
    batch = _check_batch(batch_size, max(real.shape[0], fake.shape[0]))

    real_sq = np.einsum("nd,nd->n", real, real)
    fake_sq = np.einsum("nd,nd->n", fake, fake)
    real_r = _knn_radii_sq(real, real_sq, k, batch)
    fake_r = _knn_radii_sq(fake, fake_sq, k, batch)
    fake_in, real_in = _inside_balls(fake, fake_sq, fake_r, real, real_sq, real_r, batch)
    return {"precision": float(fake_in.mean()), "recall": float(real_in.mean())}


# --------------------------------------------------------------------------------------------
def frechet_distance(a, b) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets ``a`` (N, D) and ``b`` (M, D):
    ``‖μa − μb‖² + Tr(Σa + Σb − 2 (Σa Σb)^½)``, FID's formula (Heusel et al., NeurIPS 2017) on whatever features are
    given. It is biased upward at small N (a sample's covariance is noisy), so compare values at equal sample sizes
    only: e.g. against two disjoint real samples of the same size.

    Differences from the reference: FID uses Inception-v3 pool features of 50k images; here any features (the
    synthetic judge's are the DFA aligner's, ``DFA.features``), and the matrix square root is scipy's ``sqrtm`` with
    its imaginary round-off dropped, as the reference implementations do."""
    from scipy import linalg

    a, b = _as_embeddings(a, "a"), _as_embeddings(b, "b")
    if a.shape[1] != b.shape[1]:
        raise DataError(f"frechet_distance: features of {a.shape[1]} and {b.shape[1]} dimensions")
    if min(len(a), len(b)) < 2:
        raise DataError(f"frechet_distance: needs ≥ 2 rows on each side, got {len(a)} and {len(b)}")
    diff = a.mean(axis=0) - b.mean(axis=0)
    cov_a, cov_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    root = linalg.sqrtm(cov_a @ cov_b)
    return float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(np.real(root)))


# report
# --------------------------------------------------------------------------------------------


def diversity_report(emb, labels, real_emb=None, k: int = 10) -> dict[str, float]:
    """All embedding-based synthetic-set metrics under flat ``synthetic/...`` names.

    Keys: ``synthetic/identity_consistency``, ``synthetic/diversity`` (``embedding_diversity``),
    ``synthetic/inter_class_mean_cos``, ``synthetic/inter_class_max_cos``, and with ``real_emb``
    also ``synthetic/precision@k{k}`` and ``synthetic/recall@k{k}`` (``improved_precision_recall``
    with real = ``real_emb``, fake = ``emb``, both L2-normalised first so that Euclidean distance
    is a monotone function of the cosine the FR model is trained with).

    Args:
        emb: (N, D) FR embeddings of the synthetic images; labels: (N,) their identities.
        real_emb: (M, D) FR embeddings of real images, or None to skip precision / recall.
        k: neighbour rank of precision / recall.
    """
    consistency = _per_class_mean_cos(emb, labels)
    sep = inter_class_separation(emb, labels)
    report = {
        "synthetic/identity_consistency": float(np.mean(consistency)),
        "synthetic/diversity": float(np.mean(1.0 - consistency)),
        "synthetic/inter_class_mean_cos": sep["mean_cos"],
        "synthetic/inter_class_max_cos": sep["max_cos"],
    }
    if real_emb is not None:
        fake = _unit_rows(_as_embeddings(emb, "emb"), "emb")
        real = _unit_rows(_as_embeddings(real_emb, "real_emb"), "real_emb")
        pr = improved_precision_recall(real, fake, k=k)
        report[f"synthetic/precision@k{k}"] = pr["precision"]
        report[f"synthetic/recall@k{k}"] = pr["recall"]
    return report
