"""Synthetic-face generation helpers.

- ``ml.synth.sampler``: UIFace sampling (``SamplerConfig``, ``sample``): DDIM with two-stage context switching,
  adaptive t0 and attention injection, for any diffusers ``UNet2DConditionModel``.
- ``ml.synth.attention``: the diffusers attention processors behind it (recording, injection, the switch map h_t).

Nothing is imported here: the sampler modules import diffusers (seconds), which lighter modules of this package
should not pay for.
"""
