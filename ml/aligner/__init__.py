"""Face alignment: differentiable 5-point similarity alignment (``align``) and the DFA landmark
detector (``dfa``) that predicts the 5 points for it.

Paper: KP-RPE supplementary §3, Kim et al., CVPR 2024, https://arxiv.org/abs/2403.14852. Authors' code:
https://github.com/mk-minchul/CVLface (``…/recognition/code/run_v1/aligners/differentiable_face_aligner``).
"""

from ml.aligner.align import (
    ARCFACE_TEMPLATE,
    align_faces,
    invert_affine,
    similarity_transform,
    template_for,
    transform_points,
    warp_affine,
)
from ml.aligner.dfa import ALIGNERS, DFA, DFAConfig, build_aligner, load_aligner, save_aligner

__all__ = [
    "ALIGNERS",
    "ARCFACE_TEMPLATE",
    "DFA",
    "DFAConfig",
    "align_faces",
    "build_aligner",
    "invert_affine",
    "load_aligner",
    "save_aligner",
    "similarity_transform",
    "template_for",
    "transform_points",
    "warp_affine",
]
