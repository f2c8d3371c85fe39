"""UIFace: an identity-conditioned latent diffusion generator of synthetic face datasets.

Paper: https://arxiv.org/abs/2502.19803 (Lin et al., ICLR 2025); authors' code:
https://github.com/Tencent/TFace/tree/master/generation/uiface.

``uiface`` holds the model (the ID-conditioned diffusers UNet with its learnable empty context, the pluggable
autoencoder, save/load), ``autoencoder`` and ``train`` train them, ``sampler`` and ``attention`` generate (DDIM with
two-stage context switching, adaptive t0 and attention injection), ``contexts`` finds the synthetic identities, and
``diversity`` / ``image_diversity`` measure the set. Nothing is imported here: diffusers takes seconds to import.
"""
