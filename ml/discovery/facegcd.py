"""FaceGCD (https://arxiv.org/abs/2507.22353): generalized face discovery with attention prefixes from a hypernetwork.

Two copies of one ViT. The frozen **static** ViT's token means after every block, z̄⁽ˡ⁾ (L, B, dim), drive a
hypernetwork ℋ that writes, per image and layer, a bottleneck generator ``P_K = U_K·ReLU(D_K·P_τ + b_D) + b_U``
(D (r, hd), U (hd, r), biases = their row means; P_V likewise) applied to the base prefix P_τ (P, heads, hd). The
**trainable** ViT attends with ``K̃ = [P_K; K]``, ``Ṽ = [P_V; V]`` (B, heads, P + T, hd) and unchanged queries. Only
ℋ, P_τ, the last block and the projection head train. ``features`` (the ViT's embedding head) are what is clustered;
``projections`` (a DINO head, unit norm) feed the contrastive losses, as in GCD.

Differences from the reference (§3.2–3.3, App. A.2, A.4; docs/methods/discovery.md): P_τ is learned, N(0, 1) init
(the authors' code redraws it every forward: ``learn_base_prefix=False``, one ``prefix_seed`` draw in eval); ℋ is one
MLP pair shared by all layers, with a layer embedding, on layer-normalised (non-affine) features; defaults r =
head_dim/4, hidden 4·dim/3, P = 10 (paper: 16, 1024, 20); ``static_prefix`` is plain prefix tuning (the paper's static
generator and prefix pool are not implemented); no [CLS], landmark CNN or token masking; ViTs from the FR model, its
embedding head frozen; projection head →512→512→128→256, unit-norm last rows, no gain (DINO's →2048→2048→256→65536).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError, DataError
from ml.fr.backbones import build_backbone
from ml.fr.backbones.vit import ViT
from ml.models.io import CONFIG, load_model, load_weights_into, read_model_config, write_model_dir
from ml.models.layers import Block

FORMAT = 1
ARCHITECTURE = "facegcd"


def vit_kwargs(vit: ViT) -> dict[str, Any]:
    """Constructor arguments that rebuild ``vit``'s architecture (not its weights)."""
    hidden = vit.blocks[0].mlp.fc1.out_features
    mlp_ratio = hidden / vit.dim
    if int(vit.dim * mlp_ratio) != hidden:  # ViT truncates dim·ratio; keep the rebuilt width exact
        mlp_ratio = (hidden + 0.5) / vit.dim
    return {
        "img_size": vit.img_size,
        "patch_size": vit.patch_embed.patch_size,
        "dim": vit.dim,
        "depth": vit.depth,
        "heads": vit.heads,
        "mlp_ratio": mlp_ratio,
        "embed_dim": vit.embed_dim,
        "mask_ratio": vit.mask_ratio,
        "drop_path": vit.blocks[-1].drop_path.p,
    }


def prefixed_block(block: Block, x: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> torch.Tensor:
    """``block(x)`` with ``prefix_k``/``prefix_v`` (B, heads, P, head_dim) prepended to its keys and values.

    Reuses the block's own LayerNorms, qkv/proj weights, MLP and stochastic depth; queries are unchanged, so the
    output keeps the input's shape (B, T, dim). With ``P = 0`` it is exactly ``block(x)``.
    """
    attn = block.attn
    h = block.norm1(x)
    b, t, c = h.shape
    # (3, B, heads, T, head_dim)
    qkv = attn.qkv(h).reshape(b, t, 3, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    if prefix_k.shape[2] > 0:
        k = torch.cat([prefix_k.to(k.dtype), k], dim=2)  # (B, heads, P + T, head_dim)
        v = torch.cat([prefix_v.to(v.dtype), v], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=attn.attn_drop if attn.training else 0.0)
    out = attn.proj_drop(attn.proj(out.transpose(1, 2).reshape(b, t, c)))  # (B, T, dim)
    x = x + block.drop_path(out)
    return x + block.drop_path(block.mlp(block.norm2(x)))


class PrefixHyperNetwork(nn.Module):
    """ℋ: pooled static features of every layer (L, B, dim) → per-sample prefix-generator parameters.

    Two 2-layer MLPs shared over layers ("down" and "up", as in the paper's Table A1), each writing the key and the
    value generator's matrices; the biases are the row means of the matrices (the paper's "AvgPooled" biases).
    """

    def __init__(self, dim: int, depth: int, head_dim: int, bottleneck: int, hidden: int) -> None:
        super().__init__()
        self.dim, self.head_dim, self.bottleneck = dim, head_dim, bottleneck
        self.layer_embed = nn.Parameter(torch.zeros(depth, dim))
        nn.init.trunc_normal_(self.layer_embed, std=0.02)
        # PyTorch's default Linear init: generated matrices start with entries of std ≈ 0.2, i.e. the prefix
        # generator starts near a fan-in-scaled random MLP instead of near zero (where D and U would starve
        # each other's gradients)
        self.down = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 2 * bottleneck * head_dim))
        self.up = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 2 * head_dim * bottleneck))

    def forward(self, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(L, B, dim) → D (L, B, 2, r, hd), b_D (L, B, 2, r), U (L, B, 2, hd, r), b_U (L, B, 2, hd).

        The axis of size 2 is (key, value)."""
        depth, b, _ = pooled.shape
        u = F.layer_norm(pooled, (self.dim,)) + self.layer_embed[:, None, :]  # (L, B, dim)
        r, hd = self.bottleneck, self.head_dim
        down = self.down(u).view(depth, b, 2, r, hd)
        up = self.up(u).view(depth, b, 2, hd, r)
        return down, down.mean(-1), up, up.mean(-1)


def generate_prefixes(
    base: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, up: torch.Tensor, up_bias: torch.Tensor
) -> torch.Tensor:
    """Per-sample generator ``U·ReLU(D·p + b_D) + b_U`` on every base token and head.

    ``base`` (L, B, P, heads, hd); parameters as returned by ``PrefixHyperNetwork``. Returns
    (L, B, 2, heads, P, hd): key (index 0) and value (index 1) prefixes per layer and sample.
    """
    hidden = torch.einsum("lbphe,lbkre->lbkphr", base, down) + down_bias[:, :, :, None, None, :]
    out = torch.einsum("lbkphr,lbker->lbkphe", F.relu(hidden), up) + up_bias[:, :, :, None, None, :]
    return out.transpose(3, 4)  # (L, B, 2, heads, P, hd)


class ProjectionHead(nn.Module):
    """DINO/GCD head: MLP (in → hidden → hidden → bottleneck, GELU) → L2-normalise → ``x·Ŵᵀ`` with unit-norm
    rows ``Ŵ_j = W_j/‖W_j‖`` (weight norm, gain fixed at 1) → L2-normalise. (B, in) → (B, out) on the sphere."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int, bottleneck: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, bottleneck)
        )
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last = nn.Parameter(torch.empty(out_dim, bottleneck))
        nn.init.kaiming_uniform_(self.last, a=5**0.5)  # nn.Linear's default, as DINO's weight-normed layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)  # (B, bottleneck)
        return F.normalize(F.linear(x, F.normalize(self.last, dim=1)), dim=-1)  # (B, out)


class FaceGCD(nn.Module):
    """Static ViT + hypernetwork-generated key/value prefixes in a trainable ViT + projection head.

    ``backbone`` is a registry name of a plain ViT (built with ``backbone_kwargs``) or a ``ViT`` instance; both
    ViTs are deep copies of it. ``prefix_length`` P may be 0 (no prefixes: the stock ViT). ``bottleneck`` 0 means
    ``head_dim // 4``; ``hyper_hidden`` 0 means ``4·dim // 3``.
    """

    def __init__(
        self,
        backbone: str | ViT = "vit_tiny",
        *,
        backbone_kwargs: Mapping[str, Any] | None = None,
        prefix_length: int = 10,
        bottleneck: int = 0,
        hyper_hidden: int = 0,
        learn_base_prefix: bool = True,
        static_prefix: bool = False,
        proj_dim: int = 256,
        proj_hidden: int = 512,
        proj_bottleneck: int = 128,
        prefix_seed: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(backbone, str):
            vit = build_backbone(backbone, **dict(backbone_kwargs or {}))
        elif backbone_kwargs:
            raise ConfigError("FaceGCD: backbone_kwargs apply to a backbone name only, not to a ViT instance")
        else:
            vit = backbone
        if type(vit) is not ViT:
            raise ConfigError(
                f"FaceGCD needs a plain ViT backbone (e.g. 'vit_tiny'), got {type(vit).__name__}; "
                "KP-RPE and IResNet backbones are not supported"
            )
        for name, value, low in (("prefix_length", prefix_length, 0), ("bottleneck", bottleneck, 0),
                                 ("hyper_hidden", hyper_hidden, 0), ("proj_dim", proj_dim, 1),
                                 ("proj_hidden", proj_hidden, 1), ("proj_bottleneck", proj_bottleneck, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"FaceGCD argument '{name}' must be an integer ≥ {low}, got {value!r}")
        if static_prefix and not learn_base_prefix:
            raise ConfigError(
                "FaceGCD: learn_base_prefix=False (random base prefix) has no meaning with static_prefix=True "
                "(learned prefixes, no generator); set learn_base_prefix true"
            )
        self.depth, self.heads = vit.depth, vit.heads
        self.head_dim = vit.dim // vit.heads
        self.prefix_length = prefix_length
        self.bottleneck = bottleneck or max(1, self.head_dim // 4)
        self.hyper_hidden = hyper_hidden or max(1, 4 * vit.dim // 3)
        self.learn_base_prefix = bool(learn_base_prefix)
        self.static_prefix = bool(static_prefix)
        self.prefix_seed = int(prefix_seed)
        # everything needed to rebuild this module (weights apart); see save_facegcd
        self.init_kwargs: dict[str, Any] = {
            "vit": vit_kwargs(vit), "prefix_length": prefix_length, "bottleneck": bottleneck,
            "hyper_hidden": hyper_hidden, "learn_base_prefix": self.learn_base_prefix,
            "static_prefix": self.static_prefix, "proj_dim": proj_dim, "proj_hidden": proj_hidden,
            "proj_bottleneck": proj_bottleneck, "prefix_seed": self.prefix_seed,
        }

        self.vit = copy.deepcopy(vit)
        shape = (self.depth, prefix_length, self.heads, self.head_dim)
        if self.static_prefix:
            self.static_vit: ViT | None = None
            self.hyper: PrefixHyperNetwork | None = None
            self.base_prefix: nn.Parameter | None = None
            self.kv_prefix = nn.Parameter(torch.zeros(self.depth, 2, self.heads, prefix_length, self.head_dim))
            nn.init.trunc_normal_(self.kv_prefix, std=0.02)
        else:
            self.static_vit = copy.deepcopy(vit)
            self.hyper = PrefixHyperNetwork(vit.dim, self.depth, self.head_dim, self.bottleneck, self.hyper_hidden)
            # P_τ ~ N(0, 1), like the random redraw of learn_base_prefix=False (the paper's Table A2: "uniform")
            self.base_prefix = nn.Parameter(torch.randn(shape)) if self.learn_base_prefix else None
        self.head = ProjectionHead(vit.embed_dim, proj_dim, proj_hidden, proj_bottleneck)

        for p in self.vit.parameters():
            p.requires_grad_(False)
        for p in self.vit.blocks[-1].parameters():
            p.requires_grad_(True)
        if self.static_vit is not None:
            self.static_vit.requires_grad_(False)
        self.train()

    # ------------------------------------------------------------------ structure
    @property
    def input_contract(self) -> dict[str, Any]:
        """The backbone's contract; ``embedding_dim`` is the size of ``features``."""
        return self.vit.input_contract

    def trainable_parameter_names(self) -> list[str]:
        """Names of the parameters the optimiser should see: ℋ, base prefixes, last block, projection head."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> FaceGCD:
        """Train/eval as usual, but the frozen parts (static ViT, all of the trainable ViT but its last block) stay
        in eval mode, so their dropout/stochastic depth is off and BatchNorm statistics stay fixed."""
        super().train(mode)
        self.vit.eval()
        if self.static_vit is not None:
            self.static_vit.eval()
        if mode:
            self.vit.blocks[-1].train()
        return self

    # ------------------------------------------------------------------ prefixes
    def static_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) → mean over tokens of the static ViT's output after every block (L, B, dim)."""
        if self.static_vit is None:
            raise ConfigError("static_features: this FaceGCD was built with static_prefix=True and has no static ViT")
        vit = self.static_vit
        with torch.no_grad():
            t = vit.patch_embed(x) + vit.pos_embed  # (B, T, dim)
            pooled = []
            for block in vit.blocks:
                t = block(t)
                pooled.append(t.mean(dim=1))
        return torch.stack(pooled)  # (L, B, dim)

    def _base(self, b: int, device: torch.device) -> torch.Tensor:
        """P_τ for a batch: (L, B, P, heads, hd)."""
        shape = (self.depth, self.prefix_length, self.heads, self.head_dim)
        if self.base_prefix is not None:
            return self.base_prefix[:, None].expand(-1, b, -1, -1, -1)
        if self.training:  # the authors' behaviour: a fresh draw per sample on every forward
            return torch.randn((self.depth, b) + shape[1:], device=device)
        fixed = torch.randn(shape, generator=torch.Generator().manual_seed(self.prefix_seed)).to(device)
        return fixed[:, None].expand(-1, b, -1, -1, -1)

    def prefixes(self, x: torch.Tensor) -> torch.Tensor:
        """Key/value prefixes for images (B, 3, S, S): (L, B, 2, heads, P, head_dim), index 0 keys, 1 values."""
        b = x.shape[0]
        if self.prefix_length == 0:
            return x.new_zeros(self.depth, b, 2, self.heads, 0, self.head_dim)
        if self.static_prefix:
            return self.kv_prefix[:, None].expand(-1, b, -1, -1, -1, -1)
        assert self.hyper is not None
        pooled = self.static_features(x)  # (L, B, dim)
        return generate_prefixes(self._base(b, x.device), *self.hyper(pooled))

    # ------------------------------------------------------------------ forward
    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) → final-norm tokens of the prefixed trainable ViT (B, T, dim)."""
        kv = self.prefixes(x)  # (L, B, 2, heads, P, hd)
        t = self.vit.patch_embed(x) + self.vit.pos_embed  # (B, T, dim)
        for i, block in enumerate(self.vit.blocks):
            t = prefixed_block(block, t, kv[i, :, 0], kv[i, :, 1])
        return self.vit.norm(t)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) → the trainable ViT's embedding head output (B, embed_dim), unnormalised."""
        return self.vit.feature(self.forward_tokens(x).flatten(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, 3, S, S) → (features (B, embed_dim), unnormalised; projections (B, proj_dim), unit norm)."""
        features = self.forward_features(x)
        return features, self.head(features)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RGB in [0, 1] (B, 3, S, S) → model input ``(x − mean)/std`` of the input contract."""
        c = self.input_contract
        mean = torch.tensor(c["mean"], dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(c["std"], dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std

    def embed(self, images: np.ndarray, batch_size: int = 256, flip: bool = False) -> np.ndarray:
        """uint8 RGB (N, S, S, 3) → L2-normalised ``features`` (N, embed_dim) float32, in eval mode without grad;
        with ``flip`` the features of ``f(x) + f(flip x)`` (the flip test-time augmentation FR features get)."""
        size = self.input_contract["size"]
        if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 \
                or images.shape[1:] != (size, size, 3):
            got = (images.dtype, images.shape) if isinstance(images, np.ndarray) else type(images).__name__
            raise DataError(
                f"embed: images must be uint8 (N, {size}, {size}, 3) RGB, got {got}; resize them to the contract"
            )
        if batch_size < 1:
            raise ConfigError(f"embed: batch_size must be ≥ 1, got {batch_size}")
        was_training = self.training
        device = next(self.parameters()).device
        self.eval()
        out = []
        try:
            with torch.no_grad():
                for start in range(0, len(images), batch_size):
                    chunk = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size]))
                    x = self.normalize(chunk.to(device).permute(0, 3, 1, 2).float() / 255.0)
                    feats = self.forward_features(x)
                    if flip:
                        feats = feats + self.forward_features(x.flip(3))
                    out.append(F.normalize(feats, dim=1).cpu())
        finally:
            self.train(was_training)
        dim = self.input_contract["embedding_dim"]
        return torch.cat(out).numpy() if out else np.zeros((0, dim), dtype=np.float32)

    @classmethod
    def from_fr_model(cls, model_dir: str | os.PathLike, **kwargs: Any) -> FaceGCD:
        """Both ViTs from the FR model saved in ``model_dir`` (``ml.models.io.save_model``); ``kwargs`` as __init__."""
        vit, config = load_model(model_dir)
        if type(vit) is not ViT:
            raise ConfigError(
                f"{model_dir} holds a {config.get('backbone')!r} model; FaceGCD needs a plain ViT FR model "
                "(e.g. fr.backbone vit_tiny), or use backbone_init 'random'"
            )
        return cls(vit, **kwargs)


# ---------------------------------------------------------------------- persistence
def save_facegcd(model: FaceGCD, model_dir: str | os.PathLike, *, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to ``model_dir`` (``model.safetensors`` + ``config.json`` with keys architecture, format,
    kwargs, input_contract, extra) atomically: both files go to a temporary sibling that then replaces the dir."""
    config = {
        "architecture": ARCHITECTURE,
        "format": FORMAT,
        "kwargs": model.init_kwargs,
        "input_contract": model.input_contract,
        "extra": dict(extra or {}),
    }
    return write_model_dir(model_dir, model, config, what="FaceGCD")


def load_facegcd(model_dir: str | os.PathLike) -> tuple[FaceGCD, dict[str, Any]]:
    """Rebuild the FaceGCD saved by ``save_facegcd``; return it in eval mode with its config dict."""
    config = read_model_config(model_dir, what="FaceGCD")
    config_path = Path(model_dir) / CONFIG
    if config.get("architecture") != ARCHITECTURE:
        raise DataError(f"{config_path} is not a FaceGCD model (no \"architecture\": \"{ARCHITECTURE}\"); "
                        "load FR models with ml.models.io.load_model")
    kwargs = dict(config.get("kwargs") or {})
    try:
        vit = ViT(**kwargs.pop("vit"))
        model = FaceGCD(vit, **kwargs)
    except (KeyError, TypeError, ConfigError) as exc:
        raise DataError(f"{config_path}: cannot rebuild FaceGCD from its kwargs: {exc}") from exc
    return load_weights_into(model, model_dir, what="the FaceGCD"), config


__all__ = [
    "FaceGCD",
    "PrefixHyperNetwork",
    "ProjectionHead",
    "generate_prefixes",
    "load_facegcd",
    "prefixed_block",
    "save_facegcd",
    "vit_kwargs",
]
