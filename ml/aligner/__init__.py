"""Face alignment: differentiable 5-point similarity alignment (``align``) and the DFA landmark
detector (``dfa``) that predicts the 5 points for it."""

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
