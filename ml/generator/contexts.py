"""Identity contexts for synthetic faces: keep candidates far enough apart to be different people.

UIFace (https://arxiv.org/abs/2502.19803, Sec. 3.5 "Synthetic-based face recognition") makes its synthetic
identities from unconditional samples (the empty context ``c_e``) embedded by a pre-trained FR
model, then "adopts the strategy from Kim et al. (2023) to filter out similar identity contexts
using cosine distances to ensure inter-class discrepancy". ``select_identity_contexts`` is that
filter: DCFace-style (Kim, Liu, Jain & Liu, "DCFace: Synthetic Face Generation with Dual
Condition Diffusion Model", CVPR 2023) greedy inter-class filtering.

Differences from the reference:

* UIFace ships pre-made contexts and no filtering code; DCFace's threshold and visit order are not
  part of its public sampling code. Here both are parameters: ``max_cosine`` (a candidate is kept
  iff its cosine to every kept context is strictly below it) and ``order`` (default: the given
  order, so the caller decides, e.g. by a face-quality score).
* Asking for more identities than the filter can give raises ``IdentityShortfall`` instead of
  silently returning fewer; ``allow_fewer=True`` returns them with a logged warning.
"""

from __future__ import annotations

import logging

import numpy as np

from ml.errors import ConfigError, DataError

__all__ = ["IdentityShortfall", "select_identity_contexts"]

log = logging.getLogger(__name__)

# Candidates compared against the kept set at once: a (256, K) similarity block, then a greedy pass
# over the block's survivors with their (s, s) similarities.
_BLOCK = 256


class IdentityShortfall(DataError):
    """Fewer than the asked number of identity contexts pass the inter-class filter.

    Attributes: ``found`` and ``asked`` (counts), ``max_cosine``, ``n_candidates`` and ``indices``
    (the contexts that were kept, in visit order).
    """

    def __init__(
        self,
        found: int,
        asked: int,
        *,
        max_cosine: float | None = None,
        n_candidates: int | None = None,
        indices: np.ndarray | None = None,
    ) -> None:
        self.found = int(found)
        self.asked = int(asked)
        self.max_cosine = max_cosine
        self.n_candidates = n_candidates
        self.indices = indices
        among = f" among {n_candidates} candidates" if n_candidates is not None else ""
        rule = f" with cosine < {max_cosine} to every kept one" if max_cosine is not None else ""
        super().__init__(
            f"found {self.found} identity contexts of the {self.asked} asked{among}{rule}; "
            f"generate more candidates (unconditional samples to embed) or raise max_cosine (a looser "
            f"filter, fewer near-duplicate identities rejected), or pass allow_fewer=True to go on with {self.found}"
        )

    def __reduce__(self):  # keyword-only fields survive pickling (multiprocessing, Prefect results)
        return (_rebuild_shortfall, (self.found, self.asked, self.max_cosine, self.n_candidates, self.indices))


def _rebuild_shortfall(found, asked, max_cosine, n_candidates, indices) -> IdentityShortfall:
    return IdentityShortfall(found, asked, max_cosine=max_cosine, n_candidates=n_candidates, indices=indices)


def _unit_embeddings(embeddings) -> np.ndarray:
    try:  # a torch tensor without importing torch here
        embeddings = embeddings.detach().cpu().numpy()
    except AttributeError:
        pass
    x = np.asarray(embeddings)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"embeddings must be a non-empty (N, D) array, e.g. (N, 512); got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"embeddings must hold numbers; got dtype {x.dtype}")
    x = x.astype(np.float64, copy=False)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise DataError(
            f"embeddings have {bad.size} row(s) with NaN or inf (first at row {int(bad[0])}); "
            "check the FR model output for those candidates"
        )
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    zero = np.flatnonzero(norms[:, 0] == 0)
    if zero.size:
        raise DataError(
            f"embeddings have {zero.size} all-zero row(s) (first at row {int(zero[0])}); "
            "a zero embedding has no direction, so its cosine similarity is undefined"
        )
    return x / norms  # (N, D) unit rows


def _visit_order(order, n: int) -> np.ndarray:
    if order is None:
        return np.arange(n)
    try:
        order = order.detach().cpu().numpy()
    except AttributeError:
        pass
    order = np.asarray(order)
    if order.ndim != 1 or not (np.issubdtype(order.dtype, np.integer) or order.size == 0):
        raise ConfigError(
            f"order must be a 1-D sequence of candidate indices; got shape {order.shape}, dtype {order.dtype}"
        )
    order = order.astype(np.int64)
    out = (order < 0) | (order >= n)
    if out.any():
        raise ConfigError(f"order has index {int(order[out][0])} outside the {n} candidates (valid: 0..{n - 1})")
    uniq, counts = np.unique(order, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[counts > 1][0])
        raise ConfigError(f"order visits candidate {dup} more than once; each index may appear once")
    return order


def select_identity_contexts(
    embeddings,
    n_identities: int,
    max_cosine: float,
    *,
    order=None,
    allow_fewer: bool = False,
) -> np.ndarray:
    """Greedy inter-class filtering: the first ``n_identities`` candidates that are mutually distinct.

    Candidates are L2-normalised and visited in ``order``; one is kept iff its cosine similarity to
    every context kept so far is strictly below ``max_cosine``, and the visit stops as soon as
    ``n_identities`` are kept. So every pair of kept contexts has cosine < ``max_cosine``, and the
    result is that of the one-candidate-at-a-time loop (float64; only a cosine within rounding of
    ``max_cosine`` could be judged differently). It is computed in blocks of candidates: one
    (block, kept) matrix product (float32, rechecked in float64 near the bound) rejects those too
    close to an already kept context, then a greedy pass over the block's survivors with their
    (s, s) similarities. Cost ~ N x K x D.

    Args:
        embeddings: (N, D) FR embeddings of the candidate identities (e.g. of ``c_e`` samples).
        n_identities: how many contexts to keep, >= 1.
        max_cosine: similarity bound in (-1, 1]; lower = more distinct identities, fewer kept.
        order: visit order, a 1-D sequence of distinct candidate indices (a subset visits only
            those); None visits 0..N-1.
        allow_fewer: when fewer than ``n_identities`` pass, return them with a logged warning
            instead of raising ``IdentityShortfall``.

    Returns:
        (K,) int64 indices into ``embeddings``, in the order they were kept; K = ``n_identities``
        unless ``allow_fewer`` let a shortfall through.
    """
    unit = _unit_embeddings(embeddings)
    n, d = unit.shape
    if isinstance(n_identities, bool) or not isinstance(n_identities, (int, np.integer)) or n_identities < 1:
        raise ConfigError(f"n_identities must be a positive integer; got {n_identities!r}")
    n_identities = int(n_identities)
    if isinstance(max_cosine, bool) or not isinstance(max_cosine, (int, float, np.floating, np.integer)):
        raise ConfigError(f"max_cosine must be a number in (-1, 1]; got {max_cosine!r}")
    max_cosine = float(max_cosine)
    if not -1.0 < max_cosine <= 1.0:
        raise ConfigError(f"max_cosine must be in (-1, 1] (a cosine similarity bound); got {max_cosine!r}")
    visit = _visit_order(order, n)

    # Screening in float32: faster matrix products; a float32 cosine of unit vectors is within
    # tol = 2 D eps32 (1.2e-4 at D = 512) of the float64 one, so only rows with a cosine inside
    # [max_cosine - tol, max_cosine + tol) are recomputed in float64, and every decision is float64's.
    unit32 = unit.astype(np.float32)
    tol = 2.0 * d * float(np.finfo(np.float32).eps)
    kept = np.empty(min(n_identities, visit.size), dtype=np.int64)
    kept64 = np.empty((kept.size, d))  # (K, D) unit rows of the kept contexts
    kept32 = np.empty((kept.size, d), dtype=np.float32)
    count = 0
    for lo in range(0, visit.size, _BLOCK):
        if count == n_identities:
            break
        cand = visit[lo : lo + _BLOCK]
        if count:
            sims = unit32[cand] @ kept32[:count].T  # (B, K)
            clash = (sims >= max_cosine + tol).any(axis=1)  # surely too close to a kept one
            unsure = ~clash & (sims > max_cosine - tol).any(axis=1)
            if unsure.any():
                clash[unsure] = (unit[cand[unsure]] @ kept64[:count].T >= max_cosine).any(axis=1)
            cand = cand[~clash]
        cu = unit[cand]  # (s, D) the block's survivors
        sims = cu @ cu.T  # (s, s)
        alive = np.ones(cand.size, dtype=bool)
        for i in range(cand.size):
            if not alive[i]:
                continue
            kept[count] = cand[i]
            kept64[count] = cu[i]
            kept32[count] = cu[i]
            count += 1
            if count == n_identities:
                break
            alive[i + 1 :] &= sims[i, i + 1 :] < max_cosine  # later ones too close to i are out

    kept = kept[:count]
    if count < n_identities:
        err = IdentityShortfall(count, n_identities, max_cosine=max_cosine, n_candidates=int(visit.size), indices=kept)
        if not allow_fewer:
            raise err
        log.warning("allow_fewer: %s", err)
    return kept
