"""Set fusion: many (feature, style) pairs of one person → one template.

``caface`` holds the learned Cluster-and-Aggregate model (batch and streaming inference, save/load);
``baselines`` the training-free average, norm-weighted and KP-RPE landmark-score fusions.
CAFace: Kim et al., NeurIPS 2022, https://arxiv.org/abs/2210.10864; code https://github.com/mk-minchul/caface.
KP-RPE (landmark-score fusion, supplementary Eq. 17–18): https://arxiv.org/abs/2403.14852.
"""

from ml.fusion.baselines import (
    ARCFACE_TEMPLATE_112,
    average_fusion,
    landmark_score_fusion,
    landmark_weights,
    norm_weighted_fusion,
)
from ml.fusion.caface import CAFace, ClusterOutput, FusionState, load_caface, save_caface

__all__ = [
    "ARCFACE_TEMPLATE_112",
    "CAFace",
    "ClusterOutput",
    "FusionState",
    "average_fusion",
    "landmark_score_fusion",
    "landmark_weights",
    "load_caface",
    "norm_weighted_fusion",
    "save_caface",
]
