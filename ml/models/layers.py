"""Transformer building blocks shared by the face backbones.

``Attention`` takes an optional additive bias on the attention logits, ``attn_bias`` of shape
``(B, heads, T, T)`` (or anything broadcastable to it), so that a relative-position scheme such as
KP-RPE can add ``E[h, i, bucket(i, j)]`` to ``q_i·k_j/√d`` without subclassing the block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import DataError


class DropPath(nn.Module):
    """Stochastic depth: zero a sample's residual branch with probability ``p`` during training and
    rescale the kept ones by ``1/(1−p)`` so the expectation is unchanged."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Mlp(nn.Module):
    """Linear → activation → dropout → Linear → dropout, applied per token."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        act_layer: type[nn.Module] = nn.GELU,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """Multi-head self-attention with an optional additive bias on the logits.

    ``softmax(q·kᵀ/√d + attn_bias)·v`` per head. A bias of zeros gives the same result as ``None``
    (bit for bit on the CPU; fused GPU kernels may pick a different algorithm when a bias is given).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"attention dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = float(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        # (3, B, heads, T, head_dim)
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if attn_bias is not None:
            attn_bias = attn_bias.to(q.dtype)  # (B, heads, T, T), added to the logits
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_bias, dropout_p=self.attn_drop if self.training else 0.0
        )
        out = out.transpose(1, 2).reshape(b, t, c)
        return self.proj_drop(self.proj(out))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``, each with stochastic depth."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        act_layer: type[nn.Module] = nn.GELU,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, heads, qkv_bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), attn_bias))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """Square image → non-overlapping patch tokens ``(B, grid², dim)`` by a strided convolution.

    ``grid = img_size // patch_size``; when the patch does not divide the image the convolution
    simply never reaches the last ``img_size % patch_size`` rows and columns (insightface: patch 9
    on 112 gives 12×12 patches covering 108 px).
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int = 3, dim: int = 768) -> None:
        super().__init__()
        if patch_size < 1 or patch_size > img_size:
            raise ValueError(f"patch_size {patch_size} must be in [1, img_size={img_size}]")
        self.img_size = img_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid = img_size // patch_size
        self.num_patches = self.grid * self.grid
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1:] != (self.in_chans, self.img_size, self.img_size):
            raise DataError(
                f"expected images of shape (B, {self.in_chans}, {self.img_size}, {self.img_size}), got "
                f"{tuple(x.shape)}; resize/align the images to the backbone's input contract"
            )
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, grid², dim)


def init_transformer_weights(m: nn.Module) -> None:
    """timm/insightface ViT init, for ``module.apply``: Linear truncated normal std 0.02 (biases 0), LayerNorm 1/0."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
