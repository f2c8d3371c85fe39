"""Training losses."""

from ml.losses.adaface import AdaFaceLoss
from ml.losses.lvface import LVFaceSchedule
from ml.losses.margin import ARCFACE, COSFACE, MARGINS, CombinedMarginLoss
from ml.losses.partial_fc import PartialFC, distributed_cross_entropy, gather_batch, shard_bounds

__all__ = [
    "ARCFACE",
    "COSFACE",
    "MARGINS",
    "AdaFaceLoss",
    "CombinedMarginLoss",
    "LVFaceSchedule",
    "PartialFC",
    "distributed_cross_entropy",
    "gather_batch",
    "shard_bounds",
]
