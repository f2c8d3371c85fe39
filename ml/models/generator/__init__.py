"""Synthetic-face generators.

``uiface`` holds UIFace's ID-conditioned diffusion UNet (identity context + learnable empty context), the
pluggable diffusers autoencoder for latent runs, and save/load; training lives in ``ml.train.generator``.
"""

from ml.models.generator.uiface import (
    ARCHITECTURE,
    AUTOENCODERS,
    GeneratorModelConfig,
    IDConditionedUNet,
    autoencoder_kind,
    check_latent_shape,
    decode_latents,
    encode_images,
    latent_shape,
    load_autoencoder,
    load_generator,
    save_generator,
)

__all__ = [
    "ARCHITECTURE",
    "AUTOENCODERS",
    "GeneratorModelConfig",
    "IDConditionedUNet",
    "autoencoder_kind",
    "check_latent_shape",
    "decode_latents",
    "encode_images",
    "latent_shape",
    "load_autoencoder",
    "load_generator",
    "save_generator",
]
