"""Set and video benchmarks over precomputed per-image features: fusion into templates, IJB 1:1 template
verification, video (probe-set) identification, CAFace's gain versus probe size and its robustness to frame order.

The pipeline is: ``features_and_styles`` (images → unnormalised features (N, D) and CAFace styles
(N, style_dim, 2), once) → ``fuse_templates`` (images grouped by template / probe id → unit templates (G, D))
→ ``template_verification`` (pairs of templates, TAR@FAR) or ``video_identification`` (probe templates
against gallery templates, rank-N and TPIR@FPIR). Every fusion works on the stored features, so the
backbone runs once whatever the number of fusion methods, probe sizes or shuffles compared.

Fusion methods (``FUSERS``), for a group ``g`` with images ``i ∈ g``, ``f̄_i = f_i/‖f_i‖``:

- ``average``: ``normalize(Σ_i f̄_i)``; with ``media`` the IJB media-then-template pooling
  ``normalize(Σ_m mean_{i∈m} f̄_i)`` (``ml.eval.metrics.template_features``): a video counts as one still.
- ``norm_weighted``: ``normalize(Σ_i f_i)`` (KP-RPE supp. Eq. 16: weights ∝ ‖f_i‖).
- ``landmark_score``: ``normalize(Σ_i d_i·s_i·f̄_i)``, ``d_i = (h − min(‖L_i − L̂‖₂/S, h))/h`` (KP-RPE supp.
  Eq. 17–18, ``ml.fusion.baselines.landmark_weights``) with the ArcFace template ``L̂`` scaled to the
  image side ``S``; a group whose weights are all 0 falls back to ``average`` (logged), as in the baselines.
  Landmarks outside the image are not special-cased: they are simply far from the template. Every template
  point lies at least 19.6 px of 112 (0.175·S) inside the border, so an outside landmark alone costs at least
  0.175 of the h = 0.2 budget (weight ≤ 0.12), and an image with landmarks well outside gets weight 0.
- ``quality_oracle``: ``normalize(Σ_i q_i·f̄_i)`` with ``q_i`` the renderer's true quality of image ``i`` (the
  headroom reference: what weighting frames by quality can gain; a group of all-zero quality falls back to
  ``average``).
- ``caface``: the learned CAFace (``ml.fusion.train.fuse_sets``, eval mode). ``chunk_size=None`` fuses each
  group in one call (exactly ``model(set)``); a ``chunk_size`` streams groups in chunks through the CAFace
  memory (paper Eq. 8), which is how probes of thousands of frames stay in bounded memory (the paper uses
  N' = 256 on IJB-S): the CN's self-attention costs ``width²`` per set and call. Groups are batched by
  length so that one call holds at most ``max_items`` items and ``MAX_ATTENTION`` attention pairs (a single
  group over that without ``chunk_size`` is fused alone, in one call, at its full cost).

``FusionStream`` fuses one set whose frames arrive a chunk at a time (probes of tens of thousands of frames) in
memory bounded by the chunk: running sums for the baselines and the quality oracle (given each chunk's true
quality), the CAFace memory for ``caface``; its template equals ``fuse_templates`` over the same frames (CAFace:
over the same chunks).

Groups are integer ids ``0..G-1`` per image (``np.unique(ids, return_inverse=True)`` makes them); row ``g`` of
a result is group ``g``. Variable-length groups cost one segment sum (baselines) or length-sorted padded
batches (CAFace), never a Python loop over images.

Bad input fails loudly (``DataError`` / ``ConfigError``), never as a NaN template: a non-finite or all-zero
feature (named by its row), a group id with no image, styles or landmarks of the wrong shape, non-finite
landmarks or face scores, and a group whose fused vector is exactly zero (its features cancel). A group of one
image works for every method.

Differences from the reference:

- IJB pooling (``media``) is InsightFace's ``image2template_feature`` without faceness weighting or flip
  features inside (pass features already combined, e.g. with ``features_and_styles(flip=True)``).
- ``features_and_styles(flip=True)``: features ``f(x) + f(flip x)`` (the METHODS.md convention) and styles
  the mean of both passes (the CAFace card does not say how the reference treats styles under flip; the mean
  keeps them on the scale the fusion model was trained on).
- ``gain_vs_probe_size`` (paper Fig. 1c): the paper plots the gain over averaging against the natural mean
  probe size of four datasets; here each probe of one dataset is sub-sampled (seeded, without replacement) to
  N frames for a sweep of N, so probe size is the only thing that changes. Probes shorter than N keep all
  their frames (``"frames"`` reports the mean actually used).
- ``order_robustness`` (paper Table 4, last row: 5 random orders, N' = 256): the same protocol; the std is
  the sample std (ddof 1; the paper does not say which), and the minimum cosine between a probe's template
  under two orders is reported as well.
- TAR@FAR and TPIR@FPIR use the exact order-statistic thresholds of ``ml.eval.metrics`` (no ROC
  interpolation); a FAR below ``1/n_impostor`` is reported at observed FAR 0 (threshold = the highest
  impostor score), with a logged warning.

Modules: ``features`` (``features_and_styles``), ``fusion`` (``FUSERS``, ``fuse_templates``), ``stream``
(``FusionStream``) and ``protocols`` (verification, identification, Fig. 1c and Table 4); this package exports
their public names.
"""

from ml.fusion.sets.features import features_and_styles
from ml.fusion.sets.fusion import FUSERS, FUSION_METHODS, STREAM_METHODS, fuse_templates
from ml.fusion.sets.protocols import (
    gain_vs_probe_size,
    index_pairs,
    order_robustness,
    shuffled_templates,
    template_verification,
    video_identification,
)
from ml.fusion.sets.stream import FusionStream

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
