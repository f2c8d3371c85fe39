"""Face-recognition evaluation metrics: arrays in, numbers out.

* ``verification`` - ``verification_accuracy`` (the LFW-style 10-fold pair accuracy of InsightFace),
  ``pair_correct`` (its per-pair outcomes), ``tar_at_far`` / ``roc_curve`` (the IJB-B/C 1:1 protocol) and
  ``pair_scores`` (rowwise cosine).
* ``identification`` - ``identification_rank`` (closed-set CMC), ``open_set_identification`` (TPIR at fixed
  FPIR, IJB-C / IJB-S 1:N and NIST FRVT) and ``identification_with_distractors`` (the TinyFace protocol).
* ``templates`` - ``template_features``, the IJB media-then-template pooling of InsightFace.
* ``clustering`` - ``cluster_accuracy`` (GCD All / Known / Novel), ``cluster_correct`` (its per-point outcomes) and ``nearest_neighbor_consistency`` (FaceGCD).

Each module's docstring gives the sources and its differences from the reference; this package exports their
public names.
"""

from ml.eval.metrics.clustering import cluster_accuracy, cluster_correct, nearest_neighbor_consistency
from ml.eval.metrics.identification import (
    identification_rank,
    identification_with_distractors,
    open_set_identification,
)
from ml.eval.metrics.templates import template_features
from ml.eval.metrics.verification import pair_correct, pair_scores, roc_curve, tar_at_far, verification_accuracy

__all__ = [
    "cluster_accuracy",
    "cluster_correct",
    "identification_rank",
    "identification_with_distractors",
    "nearest_neighbor_consistency",
    "open_set_identification",
    "pair_correct",
    "pair_scores",
    "roc_curve",
    "tar_at_far",
    "template_features",
    "verification_accuracy",
]
