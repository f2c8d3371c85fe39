"""Training losses: ArcFace/CosFace margins, AdaFace, PartialFC, and the LVFace schedule around them
(https://arxiv.org/abs/2501.13420; authors' repository https://github.com/bytedance/LVFace)."""

from ml.fr.losses.adaface import AdaFaceLoss
from ml.fr.losses.lvface import LVFaceSchedule
from ml.fr.losses.margin import ARCFACE, COSFACE, MARGINS, CombinedMarginLoss
from ml.fr.losses.partial_fc import PartialFC, distributed_cross_entropy, gather_batch, shard_bounds

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
