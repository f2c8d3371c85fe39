"""Plain Vision Transformer for face recognition, as used by insightface ``arcface_torch`` and LVFace.

No CLS token: the ``grid²`` patch tokens (+ a learned position embedding) pass pre-LN blocks (ReLU6 MLP of ratio 4,
qkv without bias) and a final LayerNorm, and the head flattens every token: ``Linear(T·dim → embed_dim) → BN →
Linear → BN`` (no biases). In training a share ``mask_ratio`` of tokens can be dropped before the blocks; a learned
mask token refills them after the norm. ``forward(x, return_styles=True)`` also returns CAFace styles ``(B,
dim·len(style_layers), 2)``: per channel, the mean and population std over the tokens of the residual stream after
the chosen blocks (1-based; default ``depth//2`` and ``3·depth//4``, the IResNet taps' relative depths), over the
kept tokens only while masking.

Differences from the reference (insightface ``backbones/vit.py``):

- ``mask_ratio`` defaults to 0; insightface's ``vit_t/s/b/l`` use 0.1 (pass it to reproduce them).
- ``forward`` takes an optional ``attn_bias`` (one tensor, or one per layer) added to the attention logits and
  gathered to the kept tokens under masking. No gradient checkpointing or internal autocast.
- Styles are not in insightface; ``style_layers`` adds no weights, so older checkpoints load unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ml.errors import ConfigError
from ml.models.layers import Block, PatchEmbed, init_transformer_weights

# What data code must feed the model; ``ViT.input_contract`` fills in size and embedding_dim, and adds
# style_dim (dim · number of style layers, the channels of forward(x, return_styles=True)).
INPUT_CONTRACT: dict[str, Any] = {
    "size": 112,  # square side in pixels
    "colour": "RGB",
    "scale": "x/255",  # the mean/std below apply to x/255, i.e. the model sees (x/255 - 0.5)/0.5
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "layout": "NCHW float32",
    "embedding_dim": 512,
}

AttnBias = torch.Tensor | Sequence[torch.Tensor | None] | None


def token_style(tokens: torch.Tensor) -> torch.Tensor:
    """Per-channel mean and population std over the tokens of ``(B, T, C)`` → ``(B, C, 2)``.

    ``[..., 0] = mean_t x``, ``[..., 1] = sqrt(mean_t (x − mean)²)`` (``correction=0``), the token-axis
    twin of ``iresnet.channel_style``.
    """
    var, mean = torch.var_mean(tokens, dim=1, correction=0)  # (B, C) each
    return torch.stack((mean, var.sqrt()), dim=-1)


def default_style_layers(depth: int) -> tuple[int, ...]:
    """1-based blocks tapped for styles by default: ``depth//2`` and ``3·depth//4`` (at least block 1,
    duplicates merged): depth 12 → (6, 9), 4 → (2, 3), 2 → (1,), 1 → (1,)."""
    return tuple(sorted({max(1, depth // 2), max(1, 3 * depth // 4)}))


def _gather_tokens_bias(bias: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rows and columns of ``bias`` (B|1, H, T, T) for the kept token indices ``keep`` (B, T')."""
    b, t_keep = keep.shape
    bias = bias.expand(b, -1, -1, -1)
    h, t = bias.shape[1], bias.shape[-1]
    rows = bias.gather(2, keep[:, None, :, None].expand(b, h, t_keep, t))  # (B, H, T', T)
    return rows.gather(3, keep[:, None, None, :].expand(b, h, t_keep, t_keep))  # (B, H, T', T')


class ViT(nn.Module):
    """ViT face backbone returning an unnormalised ``embed_dim`` embedding per image."""

    def __init__(
        self,
        img_size: int = 112,
        patch_size: int = 9,
        dim: int = 512,
        depth: int = 12,
        heads: int = 8,
        mlp_ratio: float = 4.0,
        embed_dim: int = 512,
        mask_ratio: float = 0.0,
        drop_path: float = 0.0,
        style_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("img_size", img_size), ("patch_size", patch_size), ("dim", dim),
                            ("depth", depth), ("heads", heads), ("embed_dim", embed_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ViT argument '{name}' must be a positive integer, got {value!r}")
        if patch_size > img_size:
            raise ConfigError(f"ViT patch_size {patch_size} is larger than img_size {img_size}")
        if dim % heads != 0:
            raise ConfigError(f"ViT dim {dim} must be divisible by heads {heads}")
        if not 0.0 <= mask_ratio < 1.0:
            raise ConfigError(f"ViT mask_ratio must be in [0, 1), got {mask_ratio}")
        if not 0.0 <= drop_path < 1.0:
            raise ConfigError(f"ViT drop_path must be in [0, 1), got {drop_path}")
        chosen = default_style_layers(depth) if style_layers is None else style_layers
        if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Sequence):
            raise ConfigError(f"ViT style_layers must be a list of 1-based block numbers or null, got {style_layers!r}")
        chosen = list(chosen)
        bad = [s for s in chosen if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= depth]
        if not chosen or bad or len(set(chosen)) != len(chosen):
            raise ConfigError(
                f"ViT style_layers must be distinct block numbers from 1 to depth={depth} (1-based; null = "
                f"{list(default_style_layers(depth))}), got {style_layers!r}"
            )
        self.style_layers = tuple(sorted(chosen))
        self.style_dim = dim * len(self.style_layers)
        self.img_size = img_size
        self.dim = dim
        self.depth = depth
        self.heads = heads
        self.embed_dim = embed_dim
        self.mask_ratio = float(mask_ratio)

        self.patch_embed = PatchEmbed(img_size, patch_size, 3, dim)
        self.num_patches = self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, dim))
        # stochastic depth grows linearly from 0 at the first block to drop_path at the last
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio, qkv_bias=False, act_layer=nn.ReLU6, drop_path=r) for r in rates
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.feature = nn.Sequential(
            nn.Linear(self.num_patches * dim, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim, eps=2e-5),
            nn.Linear(embed_dim, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim, eps=2e-5),
        )
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        self.apply(init_transformer_weights)

    @property
    def input_contract(self) -> dict[str, Any]:
        return {**INPUT_CONTRACT, "size": self.img_size, "embedding_dim": self.embed_dim, "style_dim": self.style_dim}

    def _tap(self, layer: int, x: torch.Tensor, styles: list[torch.Tensor] | None) -> None:
        """Append the style (B, dim, 2) of block ``layer``'s (1-based) output ``x`` when it is a style layer."""
        if styles is not None and layer in self.style_layers:
            styles.append(token_style(x))

    def _random_keep(self, b: int, device: torch.device) -> torch.Tensor:
        """Indices (B, T') of the tokens kept this step, T' = ⌊T·(1 − mask_ratio)⌋, at least 1."""
        keep = max(1, int(self.num_patches * (1.0 - self.mask_ratio)))
        noise = torch.rand(b, self.num_patches, device=device)
        return noise.argsort(dim=1)[:, :keep]

    def forward_features(
        self, x: torch.Tensor, attn_bias: AttnBias = None, return_styles: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Images (B, 3, S, S) → normalised tokens (B, T, dim), mask tokens at dropped places, and with
        ``return_styles`` the styles (B, style_dim, 2) of the ``style_layers`` block outputs."""
        x = self.patch_embed(x) + self.pos_embed  # (B, T, dim)
        b, t, d = x.shape
        if attn_bias is None or isinstance(attn_bias, torch.Tensor):
            biases: Sequence[torch.Tensor | None] = [attn_bias] * self.depth
        else:
            biases = list(attn_bias)
            if len(biases) != self.depth:
                raise ValueError(f"attn_bias has {len(biases)} entries for {self.depth} layers")
        keep = None
        if self.training and self.mask_ratio > 0:
            keep = self._random_keep(b, x.device)
            x = x.gather(1, keep[..., None].expand(-1, -1, d))  # (B, T', dim)
            biases = [None if a is None else _gather_tokens_bias(a, keep) for a in biases]
        styles: list[torch.Tensor] | None = [] if return_styles else None
        for layer, (block, bias) in enumerate(zip(self.blocks, biases), start=1):
            x = block(x, bias)
            self._tap(layer, x, styles)  # kept tokens only while masking
        tokens = self._unmask(self.norm(x), keep, t)
        return tokens if styles is None else (tokens, torch.cat(styles, dim=1))

    def _unmask(self, x: torch.Tensor, keep: torch.Tensor | None, t: int) -> torch.Tensor:
        """Put the kept tokens (B, T', dim) back at their places among T, the rest the mask token."""
        if keep is None:
            return x
        b, _, d = x.shape
        full = self.mask_token.expand(b, t, d).clone()
        return full.scatter(1, keep[..., None].expand(-1, -1, d), x)  # (B, T, dim)

    def forward(
        self, x: torch.Tensor, attn_bias: AttnBias = None, return_styles: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Images (B, 3, S, S) → embeddings (B, embed_dim), and with ``return_styles`` also the styles
        (B, style_dim, 2) (``[..., 0]`` token mean, ``[..., 1]`` population std, style layers in order)."""
        if not return_styles:
            return self.feature(self.forward_features(x, attn_bias).flatten(1))  # (B, embed_dim)
        tokens, styles = self.forward_features(x, attn_bias, return_styles=True)
        return self.feature(tokens.flatten(1)), styles


def _variant(defaults: dict[str, Any], overrides: dict[str, Any]) -> ViT:
    return ViT(**{**defaults, **overrides})


# Named sizes, shared with the KP-RPE variants in kprpe.py.
SIZES: dict[str, dict[str, Any]] = {
    "vit_tiny": dict(img_size=64, patch_size=8, dim=128, depth=4, heads=4, embed_dim=128),
    "vit_t": dict(img_size=112, patch_size=9, dim=256, depth=12, heads=8, drop_path=0.1),
    "vit_s": dict(img_size=112, patch_size=9, dim=512, depth=12, heads=8, drop_path=0.1),
    "vit_b": dict(img_size=112, patch_size=9, dim=512, depth=24, heads=8, drop_path=0.1),
    "vit_l": dict(img_size=112, patch_size=9, dim=768, depth=24, heads=8, drop_path=0.1),
}


def vit_tiny(**overrides: Any) -> ViT:
    """CPU default for the embedded dataset: 64 px, patch 8 (64 tokens), dim 128, depth 4, 128-d."""
    return _variant(SIZES["vit_tiny"], overrides)


def vit_t(**overrides: Any) -> ViT:
    """insightface ``vit_t``: 112 px, patch 9 (144 tokens), dim 256, depth 12, 8 heads."""
    return _variant(SIZES["vit_t"], overrides)


def vit_s(**overrides: Any) -> ViT:
    """insightface ``vit_s``: 112 px, patch 9, dim 512, depth 12, 8 heads."""
    return _variant(SIZES["vit_s"], overrides)


def vit_b(**overrides: Any) -> ViT:
    """insightface ``vit_b``: 112 px, patch 9, dim 512, depth 24, 8 heads."""
    return _variant(SIZES["vit_b"], overrides)


def vit_l(**overrides: Any) -> ViT:
    """insightface ``vit_l``: 112 px, patch 9, dim 768, depth 24, 8 heads."""
    return _variant(SIZES["vit_l"], overrides)
