"""IJB template pooling of image features: media-level mean, then template-level mean, optionally weighted.

``template_features`` follows InsightFace ``recognition/_evaluation_/ijb`` (``image2template_feature``).

Differences from the reference:

* ``template_features`` weights images only by the ``weights`` it is given (``ml.eval.ijb`` passes
  the faceness scores) and does not add flipped-image features; pass features already combined
  that way if wanted. It averages the media vectors of a template where the reference sums them
  (the same direction). A media id is scoped to its template, so the same media id in two
  templates is pooled separately.
"""

from __future__ import annotations

import numpy as np

from ml.eval.metrics._common import _as_matrix, _as_vector, _reject_zero_rows

# Images per summing step of template pooling: 65,536 x 512 float64 = 256 MiB of temporaries at most.
_POOL_ROWS = 1 << 16


def template_features(
    features: np.ndarray,
    template_ids: np.ndarray,
    media_ids: np.ndarray | None = None,
    *,
    weights: np.ndarray | None = None,
    normalize_items: bool = True,
    normalize: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """IJB template pooling: media means of (weighted) image features, then their mean, then L2-normalised.

    For template t with media m_1..m_M, each holding images i:
        f_t = normalise( (1/M) * sum_m (1/|m|) * sum_{i in m} w_i * u_i ),
    with u_i = x_i / ||x_i|| (``normalize_items``, the default) or x_i (norms kept), and w_i the
    image's weight (1 without ``weights``). A video contributes as much as a single still, however
    many frames it has. With ``media_ids=None`` each image is its own media, so f_t is the
    normalised (weighted) mean of the u_i. Media ids are scoped to their template. Images are summed
    in float64, whole media groups of at most ``_POOL_ROWS`` images at a time (IJB-C holds 469,375).

    Source: InsightFace ``recognition/_evaluation_/ijb`` ``image2template_feature``; the IJB-B/C
    protocol (Whitelam et al. 2017; Maze et al. 2018). ``ml.eval.ijb`` pools with the detector's
    faceness scores as ``weights`` and ``normalize_items=False``, the reference's default mode.

    Args:
        features: (N, D) image features.
        template_ids: (N,) template of each image.
        media_ids: (N,) media (still or video) of each image, or None.
        weights: (N,) weight of each image, finite and >= 0, or None (all 1).
        normalize_items: scale each image feature to unit norm before pooling.
        normalize: scale each template feature to unit norm; False returns the pooled means as they
            are (no zero check), for a caller that normalises them itself.

    Returns:
        (sorted unique template ids (T,), template features (T, D) float64, unit norm when
        ``normalize``).
    """
    features = _as_matrix(features, "features")
    n, dim = features.shape
    template_ids = _as_vector(template_ids, "template_ids", n)
    if weights is not None:
        weights = _as_vector(weights, "weights", n).astype(np.float64)
        bad = np.flatnonzero(~(np.isfinite(weights) & (weights >= 0)))
        if bad.size:
            raise ValueError(
                f"weights must be finite and >= 0; image {int(bad[0])} has weight {weights[bad[0]]} "
                f"({bad.size} such images)"
            )
    norms = None
    if normalize_items:
        norms = np.concatenate([  # (N,) float64, as _l2_normalize computes them
            np.linalg.norm(features[lo : lo + _POOL_ROWS].astype(np.float64, copy=False), axis=1)
            for lo in range(0, n, _POOL_ROWS)
        ])
        _reject_zero_rows(norms, "features")

    templates, t_idx = np.unique(template_ids, return_inverse=True)  # t_idx: (N,)
    if media_ids is None:
        m_idx = np.arange(n)
        n_media = n
    else:
        media_ids = _as_vector(media_ids, "media_ids", n)
        media, m_idx = np.unique(media_ids, return_inverse=True)
        n_media = media.size
    key = t_idx.astype(np.int64) * n_media + m_idx  # (template, media) pairs, template-major
    order = np.argsort(key, kind="stable")
    key = key[order]
    media_starts = np.flatnonzero(np.r_[True, np.diff(key) != 0])
    edges = np.r_[media_starts, n]  # (M + 1,) media group boundaries in sorted order
    media_sizes = np.diff(edges)

    sums = np.empty((media_starts.size, dim))  # (M, D) sum_{i in m} w_i u_i
    first = 0  # a step sums whole media groups: up to _POOL_ROWS images, or one larger group
    while first < media_starts.size:
        stop = max(first + 1, int(np.searchsorted(edges, edges[first] + _POOL_ROWS, side="right")) - 1)
        rows = order[edges[first] : edges[stop]]
        x = features[rows].astype(np.float64, copy=False)  # (B, D), a copy of these rows only
        if norms is not None:
            x /= norms[rows, None]
        if weights is not None:
            x *= weights[rows, None]
        sums[first:stop] = np.add.reduceat(x, media_starts[first:stop] - edges[first], axis=0)
        first = stop
    media_mean = sums / media_sizes[:, None]  # (M, D)

    media_template = key[media_starts] // n_media  # (M,) sorted
    template_starts = np.flatnonzero(np.r_[True, np.diff(media_template) != 0])
    template_sizes = np.diff(np.r_[template_starts, media_mean.shape[0]])
    pooled = np.add.reduceat(media_mean, template_starts, axis=0) / template_sizes[:, None]  # (T, D)
    if not normalize:
        return templates, pooled

    norms = np.linalg.norm(pooled, axis=1)
    cancelled = np.flatnonzero(norms <= 1e-12)
    if cancelled.size:
        raise ValueError(
            f"template {templates[cancelled[0]]!r} pools to a zero vector (its media features "
            "cancel out); check its images"
        )
    return templates, pooled / norms[:, None]
