"""Set and video benchmarks on stored per-image features: IJB-B/C-style templates and IJB-S-style video probes.

``features_and_styles`` (once per image) → ``fuse_templates`` (group ids 0..G-1 → unit templates (G, D)) →
``template_verification`` (TAR@FAR), ``video_identification`` (rank-N, TPIR@FPIR), ``gain_vs_probe_size`` (Fig. 1c),
``order_robustness`` (Table 4); ``FusionStream`` fuses one set a chunk at a time. ``FUSERS`` (``f̄_i = f_i/‖f_i‖``,
each normalised; all-zero weights fall back to ``average``): ``average`` ``Σ f̄_i`` (``media``: IJB media pooling),
``norm_weighted`` ``Σ f_i``, ``landmark_score`` ``Σ d_i·s_i·f̄_i`` (KP-RPE supp. Eq. 17–18), ``caface`` (eval mode,
streamed in ``chunk_size``), ``quality_oracle`` ``Σ q_i·f̄_i`` (renderer's true quality: a reference, not a method).
CAFace's protocols: https://arxiv.org/abs/2210.10864; its code: https://github.com/mk-minchul/caface.

Differences from the reference:
- ``media`` is InsightFace's ``image2template_feature`` without faceness weights; ``flip=True`` features are
  ``f(x) + f(flip x)`` and styles the mean of both passes (unspecified on the CAFace card).
- Fig. 1c: each probe is sub-sampled to N frames (seeded) instead of comparing datasets of different mean sizes.
- Table 4's order test: sample std (ddof 1) and the minimum template cosine between orders; TAR/TPIR at exact
  order-statistic thresholds, a FAR below ``1/n_impostor`` reported at observed FAR 0 (logged).
"""

from ml.fusion.sets.features import features_and_styles
from ml.fusion.sets.fusers import FUSERS, FUSION_METHODS, STREAM_METHODS, fuse_templates
from ml.fusion.sets.protocols import (
    gain_vs_probe_size,
    index_pairs,
    order_robustness,
    shuffled_templates,
    template_verification,
    video_identification,
)
from ml.fusion.sets.fusion_stream import FusionStream

__all__ = [
    "FUSERS",
    "FUSION_METHODS",
    "STREAM_METHODS",
    "FusionStream",
    "features_and_styles",
    "fuse_templates",
    "gain_vs_probe_size",
    "index_pairs",
    "order_robustness",
    "shuffled_templates",
    "template_verification",
    "video_identification",
]
