"""The generalized face discovery (GFD) evaluation protocol over one set of features.

Every image of the split (train and test) is clustered at once with K = number of identities (known + novel, the
GCD assumption that K is given); the labelled images of the known identities are fixed to their class. Accuracy
(``cluster_accuracy``: one Hungarian matching, then All / Known / Novel) is reported on two subsets:

- ``test``: the held-out 10 % of every identity (the FaceGCD split's test images), never labelled;
- ``transductive``: the unlabelled training images, the usual GCD protocol (clustering the data you have).

``nnc`` is the nearest-neighbour consistency of the test predictions (``k`` neighbours among the test images).

The unsupervised baselines' settings (linkage, DBSCAN grid point) are chosen on the labelled images, the only labels
a method is given: no test or transductive label is read before scoring. ``gfd_chance`` is the level a random
partition with the true cluster sizes reaches under the same matching (Hungarian matching flatters small subsets:
with two test images per identity it is far above 1/K).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ml.discovery.baselines import agglomerative_baseline, best_of, dbscan_baseline, kmeans_baseline
from ml.discovery.ssk import semi_supervised_kmeans
from ml.errors import DataError
from ml.eval.metrics import cluster_accuracy, nearest_neighbor_consistency

__all__ = ["GFDOutcome", "gfd_baselines", "gfd_chance", "gfd_ssk", "known_or_new_names"]


@dataclass(frozen=True, eq=False)
class GFDOutcome:
    """Predicted cluster per image (N,), the metrics (``test/all``, ``test/known``, ..., ``nnc``), and for SSK the
    known classes in cluster order (cluster i < len(known_classes) is known class ``known_classes[i]``)."""

    pred: np.ndarray
    metrics: dict[str, float]
    known_classes: np.ndarray | None = None
    setting: str = ""


def _masks(labels: np.ndarray, labelled: np.ndarray, known: np.ndarray, test: np.ndarray) -> None:
    n = len(labels)
    for name, m in (("labelled", labelled), ("known", known), ("test", test)):
        if m.shape != (n,) or m.dtype != bool:
            raise DataError(f"{name} mask must be bool of shape ({n},), got {m.dtype} {m.shape}")
    if (labelled & test).any():
        raise DataError("a test image is labelled: the test subset would measure memorisation; fix the GFD split")
    if (labelled & ~known).any():
        raise DataError("a labelled image belongs to an unknown identity; fix the GFD split")
    if not test.any():
        raise DataError("the GFD split has no test image; raise data.gfd_test_fraction")


def _score(pred: np.ndarray, labels: np.ndarray, known: np.ndarray, subsets: dict[str, np.ndarray]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, m in subsets.items():
        if m.any():
            for k, v in cluster_accuracy(labels[m], pred[m], known[m]).items():
                out[f"{name}/{k}"] = v
    return out


def _nnc(features: np.ndarray, pred: np.ndarray, test: np.ndarray, k: int) -> float:
    n = int(test.sum())
    return nearest_neighbor_consistency(features[test], pred[test], min(k, n - 1)) if n > 1 else float("nan")


def gfd_ssk(
    features: np.ndarray, labels: np.ndarray, labelled: np.ndarray, known: np.ndarray, test: np.ndarray, *,
    n_init: int = 10, max_iter: int = 500, seed: int = 0, nnc_k: int = 5,
) -> GFDOutcome:
    """Semi-supervised k-means over all images (features L2-normalised first), scored on test and transductive."""
    _masks(labels, labelled, known, test)
    x = features / np.linalg.norm(features, axis=1, keepdims=True).clip(1e-12)
    k = len(np.unique(labels))
    res = semi_supervised_kmeans(x, labels, labelled, k, n_init=n_init, max_iter=max_iter, seed=seed)
    metrics = _score(res.labels, labels, known, {"test": test, "transductive": ~test & ~labelled})
    metrics["nnc"] = _nnc(x, res.labels, test, nnc_k)
    return GFDOutcome(res.labels, metrics, res.known_classes, "ssk")


def gfd_baselines(
    features: np.ndarray, labels: np.ndarray, labelled: np.ndarray, known: np.ndarray, test: np.ndarray, *,
    eps_grid: Sequence[float], min_samples_grid: Sequence[int], seed: int = 0, nnc_k: int = 5,
) -> dict[str, GFDOutcome]:
    """Unsupervised baselines (no labels used for clustering) on the same images: k-means, agglomerative (the best
    linkage) and DBSCAN (the best grid point), "best" by clustering accuracy on the labelled images only."""
    _masks(labels, labelled, known, test)
    x = features / np.linalg.norm(features, axis=1, keepdims=True).clip(1e-12)
    k = len(np.unique(labels))
    subsets = {"test": test, "transductive": ~test & ~labelled}  # the same subsets SSK is scored on
    out: dict[str, GFDOutcome] = {}
    candidates = {
        "kmeans": {"k=K": kmeans_baseline(x, k, seed)},
        "agglomerative": agglomerative_baseline(x, k),
        "dbscan": dbscan_baseline(x, eps_grid, min_samples_grid),
    }
    for name, preds in candidates.items():
        key, _, _ = best_of({s: p[labelled] for s, p in preds.items()}, labels[labelled], known[labelled])
        pred = preds[key]
        metrics = _score(pred, labels, known, subsets)
        metrics["nnc"] = _nnc(x, pred, test, nnc_k)
        out[name] = GFDOutcome(pred, metrics, None, str(key))
    return out


def gfd_chance(labels: np.ndarray, labelled: np.ndarray, known: np.ndarray, test: np.ndarray, *,
               draws: int = 20, seed: int = 0) -> GFDOutcome:
    """Chance level: the mean metrics of ``draws`` random partitions of all images with the true cluster sizes
    (the labels permuted), scored like every method; ``pred`` is the first draw."""
    _masks(labels, labelled, known, test)
    rng = np.random.default_rng(seed)
    subsets = {"test": test, "transductive": ~test & ~labelled}
    preds = [rng.permutation(labels) for _ in range(draws)]
    scores = [_score(p, labels, known, subsets) for p in preds]
    metrics = {key: float(np.mean([s[key] for s in scores])) for key in scores[0]}
    return GFDOutcome(preds[0], metrics, None, f"mean of {draws} random partitions")


def known_or_new_names(outcome: GFDOutcome, class_names: Sequence[str]) -> list[str]:
    """Per image: the known identity's name for a known-class cluster, else ``new-<cluster id>``."""
    known = outcome.known_classes if outcome.known_classes is not None else np.zeros(0, dtype=np.int64)
    return [class_names[known[c]] if c < len(known) else f"new-{int(c):04d}" for c in outcome.pred]
