"""Identity consistency and diversity of a synthetic face dataset: embeddings in, numbers out.

UIFace (``shared/papers/uiface.txt``) judges a synthetic set by how alike the
images of one identity look to a face-recognition (FR) model and by how varied they still are:

* ``identity_consistency`` - mean intra-class cosine similarity under the FR model (the genuine
  similarity of UIFace Fig. 5 / Table 2).
* ``embedding_diversity`` - mean intra-class cosine *distance*, an embedding-space proxy for the
  intra-class LPIPS of UIFace Table 2 (LPIPS needs VGG16 weights that are not available offline).
* ``inter_class_separation`` - mean and max cosine between class centres: how distinct the
  synthetic identities are from one another.
* ``improved_precision_recall`` - Kynkäänniemi, Karras, Laine, Lehtinen & Aila, "Improved
  Precision and Recall Metric for Assessing Generative Models", NeurIPS 2019; UIFace reports the
  recall ("ImRecall", k = 10).
* ``lpips_distance`` - LPIPS (Zhang, Isola, Efros, Shechtman & Wang, "The Unreasonable
  Effectiveness of Deep Features as a Perceptual Metric", CVPR 2018), VGG16 variant, only from a
  local weights file.
* ``diversity_report`` - the above as flat ``synthetic/...`` metric names.

Differences from the reference:

* UIFace computes Improved Recall on Inception embeddings of 10k x 50 images and LPIPS with a VGG on
  100 identities. Here precision / recall run on whatever embeddings are passed (in
  ``diversity_report``: the L2-normalised FR embeddings), and the default diversity number is the
  embedding-space proxy, because no Inception or VGG weights can be downloaded offline.
* ``improved_precision_recall`` counts a sample as inside a ball when its distance is <= the
  radius, and compares squared distances, as the reference code (kynkaat/improved-precision-and-
  recall-metric, ``precision_recall.py``, ``ManifoldEstimator.evaluate``) does. Distances are float64
  in row blocks of a memory budget, where the reference uses float32 (optionally float16) blocks of
  fixed size; the reference's optional pruning of outlier radii is omitted.
* ``lpips_distance`` reads one state dict holding both the VGG16 features and the linear layers
  (``lpips`` ships them in two files); it skips the dropout before each linear layer (inference
  only) and returns per-pair distances averaged over space (``spatial=False``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ml.errors import ConfigError, DataError

__all__ = [
    "LPIPS",
    "adjacent_pixel_correlation",
    "diversity_report",
    "identity_gap",
    "embedding_diversity",
    "identity_consistency",
    "improved_precision_recall",
    "inter_class_separation",
    "load_lpips",
    "lpips_distance",
    "nearest_real",
    "per_class_consistency",
    "ssim_diversity",
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
    the ``max_cosine`` bound of ``ml.synth.contexts.select_identity_contexts``). A class of one embedding is
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


def adjacent_pixel_correlation(images) -> float:
    """Mean over images of the Pearson correlation between horizontally adjacent pixel values (all channels).

    Natural faces are smooth at the pixel scale (≈ 0.95–0.99 at 64 px); colour noise is not (a generator that has
    not learnt faces gives ≈ 0.8 and below). ``images``: uint8 or float (N, H, W, C), W ≥ 2."""
    x = np.asarray(images, dtype=np.float64)
    if x.ndim != 4 or x.shape[2] < 2 or len(x) == 0:
        raise DataError(f"images must be (N, H, W, C) with N ≥ 1 and W ≥ 2, got shape {x.shape}")
    a = x[:, :, :-1].reshape(len(x), -1)
    b = x[:, :, 1:].reshape(len(x), -1)
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    flat = den <= 1e-12  # a constant image: perfectly smooth
    corr = np.where(flat, 1.0, (a * b).sum(axis=1) / np.where(flat, 1.0, den))
    return float(corr.mean())


def ssim_diversity(images, labels, max_per_class: int = 8) -> float:
    """Pixel-space diversity within identity that needs no network weights: mean over identities of the mean
    ``1 − SSIM`` over pairs of its first ``max_per_class`` faces (grey levels, torchmetrics' Gaussian-window SSIM).
    0 = every face of an identity identical; higher = more pose/lighting variation. A companion to the embedding
    proxy, since LPIPS needs VGG weights."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    x = np.asarray(images)
    lab = _as_labels(labels, len(x))
    if x.ndim != 4 or x.shape[-1] != 3:
        raise DataError(f"images must be (N, H, W, 3) RGB, got shape {x.shape}")
    grey = torch.from_numpy(x.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[:, None] / 255.0
    per_class = []
    for c in np.unique(lab):
        rows = np.flatnonzero(lab == c)[:max_per_class]
        if len(rows) < 2:
            continue
        i, j = np.triu_indices(len(rows), k=1)
        a, b = grey[rows[i]], grey[rows[j]]
        values = ssim(a, b, data_range=1.0, reduction="none", kernel_size=7 if x.shape[1] >= 7 else 3)
        per_class.append(float((1.0 - values).mean()))
    if not per_class:
        raise DataError("SSIM diversity needs an identity with ≥ 2 faces")
    return float(np.mean(per_class))


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
    fake x fake, and fake x real shared by precision and recall), ~ (N_r + N_f)^2 x D multiply-adds:
    20k x 20k in 512-d is about a minute on one CPU core.

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
# LPIPS (VGG16), local weights only
# --------------------------------------------------------------------------------------------

# torchvision ``vgg16().features`` (configuration "D", no batch norm): numbers are 3x3 convs
# (padding 1) each followed by ReLU, "M" a 2x2 max-pool. Module indices match torchvision's, so its
# ``features.<i>.weight`` keys load directly.
_VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512)
_LPIPS_TAPS = (3, 8, 15, 22, 29)  # relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
_LPIPS_CHANNELS = (64, 128, 256, 512, 512)
_MIN_SIDE = 16  # four 2x2 pools before relu5_3: 16 -> 1


class VGG16Features(nn.Module):
    """The convolutional part of VGG16 up to relu5_3; ``forward`` returns the five LPIPS taps."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for item in _VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(in_ch, item, kernel_size=3, padding=1), nn.ReLU()]
                in_ch = item
        self.features = nn.Sequential(*layers)  # indices 0..29
        assert len(self.features) == _LPIPS_TAPS[-1] + 1

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        taps = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in _LPIPS_TAPS:
                taps.append(x)  # (N, C_l, H / 2^l, W / 2^l)
        return taps


class LPIPS(nn.Module):
    """LPIPS-VGG (Zhang et al., CVPR 2018): a distance between images of the same size.

        d(x, y) = sum_l mean_{h,w} sum_c w_{l,c} (f^l_{hwc}(x) - f^l_{hwc}(y))^2

    f^l are the VGG16 activations at relu1_2 .. relu5_3, each normalised to unit L2 norm over
    channels at every position; w_l are the learned non-negative 1x1 linear weights. Inputs are
    RGB in [-1, 1], shifted and scaled by LPIPS's fixed ``ScalingLayer`` constants first.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = VGG16Features()
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, kernel_size=1, bias=False) for c in _LPIPS_CHANNELS)
        # ImageNet mean / std mapped to [-1, 1] (lpips ``ScalingLayer``); constants, not weights.
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1), persistent=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) pairs in [-1, 1] -> (N,) distances."""
        feats_a = self.net((a - self.shift) / self.scale)
        feats_b = self.net((b - self.shift) / self.scale)
        total = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
        for lin, fa, fb in zip(self.lins, feats_a, feats_b):
            fa = fa / (fa.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)  # unit norm over channels
            fb = fb / (fb.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            total = total + lin((fa - fb).pow(2)).mean(dim=(1, 2, 3))  # (N, 1, h, w) -> (N,)
        return total


# Accepted key spellings -> our module's keys.
_KEY_RULES = (
    (re.compile(r"^(?:net\.)?features\.(\d+)\.(weight|bias)$"), "net.features.{0}.{1}"),  # torchvision / ours
    (re.compile(r"^net\.slice\d\.(\d+)\.(weight|bias)$"), "net.features.{0}.{1}"),  # lpips.LPIPS().state_dict()
    (re.compile(r"^lin(\d)\.model\.1\.weight$"), "lins.{0}.weight"),  # lpips weights/v0.1/vgg.pth
    (re.compile(r"^lins\.(\d)\.weight$"), "lins.{0}.weight"),  # ours
)
_IGNORED_KEYS = re.compile(r"^(classifier\.|scaling_layer\.|(net\.)?shift$|(net\.)?scale$)")

_LPIPS_HELP = (
    "LPIPS needs VGG16 + LPIPS weights available offline, and nothing here downloads them. Save one "
    "state dict holding torchvision's VGG16 'features.*' tensors (vgg16-397923af.pth) and the LPIPS v0.1 "
    "linear layers 'lin0..lin4' (lpips/weights/v0.1/vgg.pth), e.g. "
    "torch.save({**torch.load(vgg16_pth), **torch.load(lpips_vgg_pth)}, 'models/lpips_vgg16.pth'), "
    "and pass that path as weights_path; without it use embedding_diversity, the embedding-space proxy"
)


def load_lpips(weights_path: str | Path | None) -> LPIPS:
    """An eval-mode ``LPIPS`` with every weight read from the local state dict at ``weights_path``.

    Accepted keys: torchvision ``features.<i>.weight|bias`` (``classifier.*`` ignored) or lpips's
    ``net.slice<s>.<i>.*``; lpips ``lin<l>.model.1.weight``; or this module's own state dict. Every
    VGG16 conv and every linear layer must be present: a missing or unknown key raises ConfigError.
    """
    if weights_path is None:
        raise ConfigError(f"no LPIPS weights_path given. {_LPIPS_HELP}")
    path = Path(weights_path)
    if not path.is_file():
        raise ConfigError(f"LPIPS weights file {path} does not exist. {_LPIPS_HELP}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise ConfigError(f"cannot read LPIPS weights {path} as a torch state dict ({exc}). {_LPIPS_HELP}") from exc
    if not isinstance(state, Mapping):
        raise ConfigError(f"LPIPS weights {path} hold a {type(state).__name__}, not a state dict. {_LPIPS_HELP}")

    mapped, unknown = {}, []
    for key, value in state.items():
        for pattern, target in _KEY_RULES:
            m = pattern.match(key)
            if m:
                mapped[target.format(*m.groups())] = value
                break
        else:
            if not _IGNORED_KEYS.match(key):
                unknown.append(key)
    model = LPIPS()
    expected = set(model.state_dict())
    missing = sorted(expected - set(mapped))
    unknown += sorted(set(mapped) - expected)
    if missing or unknown:
        raise ConfigError(
            f"LPIPS weights {path} do not fit VGG16 + LPIPS: missing {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''} ({len(missing)} in all), unknown {unknown[:6]}. {_LPIPS_HELP}"
        )
    own = model.state_dict()
    for key, value in mapped.items():
        want = own[key].shape
        if tuple(value.shape) != tuple(want):
            raise ConfigError(f"LPIPS weights {path}: {key} has shape {tuple(value.shape)}, expected {tuple(want)}")
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def _as_images(x, name: str) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.ndim != 4 or t.shape[1] != 3:
        raise DataError(f"{name} must be (N, 3, H, W) RGB images; got shape {tuple(t.shape)}")
    if t.shape[2] < _MIN_SIDE or t.shape[3] < _MIN_SIDE:
        raise DataError(
            f"{name} images are {t.shape[2]}x{t.shape[3]}; LPIPS-VGG needs at least {_MIN_SIDE}x{_MIN_SIDE}"
        )
    if not t.is_floating_point():
        raise DataError(f"{name} must be float images in [-1, 1]; got dtype {t.dtype} (map uint8 with x / 127.5 - 1)")
    t = t.float()
    if not torch.isfinite(t).all():
        raise DataError(f"{name} has NaN or inf pixels")
    lo, hi = float(t.min()), float(t.max())
    if lo < -1.0 - 1e-5 or hi > 1.0 + 1e-5:
        raise DataError(f"{name} values span [{lo:.3g}, {hi:.3g}]; LPIPS expects [-1, 1] (from [0, 1] use 2x - 1)")
    return t


def lpips_distance(
    images_a, images_b, weights_path: str | Path | None = None, *, model: LPIPS | None = None, batch_size: int = 32
) -> np.ndarray:
    """Per-pair LPIPS-VGG distance between ``images_a[i]`` and ``images_b[i]`` (see ``LPIPS``).

    Only available with local weights: pass ``weights_path`` (a state dict, see ``load_lpips``) or an
    already loaded ``model``. With neither, ConfigError explains where to put the weights. Runs on
    the model's device (CPU when loaded from a path), ``batch_size`` pairs at a time, without grad.

    Args:
        images_a, images_b: (N, 3, H, W) float RGB in [-1, 1], same shape, H, W >= 16.
        weights_path: local VGG16 + LPIPS state dict.
        model: a loaded ``LPIPS``, to skip reloading across calls.

    Returns:
        (N,) float64 distances >= 0 with trained (non-negative) linear weights; 0 for identical images.
    """
    if model is None:
        model = load_lpips(weights_path)
    a = _as_images(images_a, "images_a")
    b = _as_images(images_b, "images_b")
    if a.shape != b.shape:
        raise DataError(f"images_a and images_b must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer; got {batch_size!r}")
    model.eval()
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for lo in range(0, a.shape[0], batch_size):
            out.append(model(a[lo : lo + batch_size].to(device), b[lo : lo + batch_size].to(device)).cpu())
    return torch.cat(out).double().numpy() if out else np.zeros(0)


# --------------------------------------------------------------------------------------------
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
