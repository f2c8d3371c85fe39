"""CAFace: Cluster and Aggregate fusion of a set of face features into one template (Kim et al., NeurIPS 2022).

Per image: unnormalised feature ``f`` (D = 512) and backbone style ``Γ`` (384, 2). SIM → key token ``s = [γ; n]``
(d = 128): ``γ = BN(Linear(PReLU(Σ_k Γ[:, k]·Ws[:, k])))``, ``n = β·T[trunc(clip(BN‖f‖, ±3)·10) + 30]``, T sinusoids.
CN: transformer over ``[S; C]`` (M = 4 centres), ``A = softmax_M(Q(LN C)·K(LN S)ᵀ/√d)`` (B, M, N),
``Â = A/max(1, Σ_t A)``, ``F' = Â·F_unit`` (B, M, D), ``S' = Â·LN(S)`` (B, M, d). AGN: gated mixer over ``[C; S']``,
per-channel ``P = softmax_M``, template ``Σ_m P_m ⊙ F'_m``. Streaming (Eq. 7–8): the memory ``(c̄, F̄', S̄')`` absorbs
a chunk at a time, the same in any chunk order; a chunked set differs from one call (attention stays in a chunk).

Differences from the reference (``mk-minchul/caface``, config ``catv9_g4_conf512_small``):
- Update ``F̄' ← (max(1, c̄)·F̄' + A·F_unit)/max(1, c̄ + c)``: Eq. 8 when ``c̄, c ≥ 1``, exactly Eq. 7 below.
- ``F_unit = F.normalize(f)`` (not ``f/(‖f‖ + 1e-5)``); the template is L2-normalised; sinusoids are not saved.
- ``mask`` (B, N) pads sets of different lengths: out of both BatchNorms, attention and assignment.
- As the reference, not the paper: PReLU and weighted sum in SIM (Eq. 4), a shared LayerNorm and skip gate per
  mixer block, qkv biases, drop path 0 → 0.1, trunc-normal init. Details: ``docs/methods/fusion.md``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError, DataError
# WEIGHTS/CONFIG stay importable from this module, where they used to be defined.
from ml.models.io import CONFIG, WEIGHTS, load_weights_into, read_model_config, write_model_dir  # noqa: F401
from ml.models.layers import Block, Mlp, init_transformer_weights

FORMAT = 1
LN_EPS = 1e-5  # nn.LayerNorm's default, as in the reference


def sinusoid_table(rows: int, dim: int) -> torch.Tensor:
    """Transformer sinusoid table ``(rows, dim)``: ``T[p, 2i] = sin(p·ω_i)``, ``T[p, 2i+1] = cos(p·ω_i)``,
    ``ω_i = 10000^{−2i/dim}`` (Vaswani et al. 2017). ``dim`` must be even."""
    position = torch.arange(rows, dtype=torch.float64).unsqueeze(1)  # (rows, 1)
    omega = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))  # (dim/2,)
    table = torch.zeros(rows, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * omega)
    table[:, 1::2] = torch.cos(position * omega)
    return table.float()


def assign_average(assignment: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster averages ``Â·V`` with ``Â = A / max(1, Σ_t A)`` per cluster, the divisor detached.

    ``assignment`` A (B, M, N), ``values`` V (B, N, C) → (``Â·V`` (B, M, C), count ``c = Σ_t A`` (B, M)).
    Detaching the divisor makes ``∂(Â·V)/∂A = V / max(1, c)`` with no term through ``c`` (paper Eq. 3).
    """
    count = assignment.sum(dim=-1)  # (B, M)
    divisor = count.detach().clamp_min(1.0)  # (B, M), ≥ 1
    return (assignment @ values) / divisor.unsqueeze(-1), count


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"CAFace argument '{name}' must be a positive integer, got {value!r}")
    return value


class StyleInputMaker(nn.Module):
    """SIM: style ``Γ`` (K, style_dim, 2) and feature norms (K,) of K images → key tokens ``s`` (K, d).

    ``γ = BN(Linear(PReLU(Σ_k Γ[:, :, k]·Ws[:, k])))`` (K, style_embed_dim) and
    ``n = β·T[trunc(clip(BN(‖f‖), −c, c)·b) + c·b]`` (K, norm_embed_dim), ``c`` = ``norm_clip`` (3),
    ``b`` = ``norm_bins`` (10) per unit, so ``T`` has ``2cb + 1`` = 61 rows; ``s = [γ; n]``.
    """

    def __init__(
        self, style_dim: int, style_embed_dim: int = 64, norm_embed_dim: int = 64, norm_clip: int = 3, norm_bins: int = 10
    ) -> None:
        super().__init__()
        self.style_weight = nn.Parameter(torch.zeros(style_dim, 2))  # Ws, zero-init: z = 0 at the start
        self.act = nn.PReLU()
        self.linear = nn.Linear(style_dim, style_embed_dim)
        self.bn = nn.BatchNorm1d(style_embed_dim)
        self.norm_bn = nn.BatchNorm1d(1, affine=False)
        self.norm_clip = norm_clip
        self.norm_bins = norm_bins
        self.register_buffer("table", sinusoid_table(2 * norm_clip * norm_bins + 1, norm_embed_dim), persistent=False)
        self.norm_scale = nn.Parameter(torch.tensor(0.1))  # β

    def style_embedding(self, styles: torch.Tensor) -> torch.Tensor:
        """``γ`` (K, style_embed_dim) from ``Γ`` (K, style_dim, 2)."""
        z = (styles * self.style_weight).sum(dim=-1)  # (K, style_dim)
        return self.bn(self.linear(self.act(z)))

    def norm_rows(self, norms: torch.Tensor) -> torch.Tensor:
        """Table rows (K,) int64 in [0, 2cb] for feature norms (K,): ``trunc(clip(BN(‖f‖), −c, c)·b) + cb``."""
        u = self.norm_bn(norms.unsqueeze(-1)).squeeze(-1)  # (K,), ~N(0, 1) over the batch / running stats
        scaled = u.clamp(-self.norm_clip, self.norm_clip) * self.norm_bins  # [−30, 30]
        return scaled.long() + self.norm_clip * self.norm_bins  # .long() truncates toward zero

    def forward(self, norms: torch.Tensor, styles: torch.Tensor) -> torch.Tensor:
        norm_embedding = self.norm_scale * self.table[self.norm_rows(norms)]  # (K, norm_embed_dim)
        return torch.cat([self.style_embedding(styles), norm_embedding], dim=-1)  # (K, d)


class ClusterNetwork(nn.Module):
    """CN: key tokens ``S`` (B, N, d) → assignment ``A`` (B, M, N) and normalised keys ``LN(S)`` (B, N, d).

    ``[S; C]`` → ``depth`` pre-LN transformer blocks → updated ``S`` →
    ``A = softmax over M of (W_q LN_C(C) + b_q)(W_k LN_S(S) + b_k)ᵀ / √d``.
    """

    def __init__(
        self, dim: int, num_clusters: int, depth: int, heads: int, mlp_ratio: float, drop_path_rate: float
    ) -> None:
        super().__init__()
        centres = torch.empty(num_clusters, dim)
        nn.init.orthogonal_(centres)  # orthonormal rows when M ≤ d
        self.centres = nn.Parameter(centres / centres.norm(dim=-1, keepdim=True))  # C (M, d)
        rates = torch.linspace(0.0, drop_path_rate, depth).tolist() if depth > 1 else [0.0]
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio=mlp_ratio, qkv_bias=True, drop_path=r, norm_eps=LN_EPS) for r in rates
        )
        self.norm_centres = nn.LayerNorm(dim, eps=LN_EPS)
        self.norm_keys = nn.LayerNorm(dim, eps=LN_EPS)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.scale = dim**-0.5

    # device types on which sets padded at the end run one length at a time (see _by_length); elsewhere one masked call
    by_length_devices: tuple[str, ...] = ("cpu",)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if valid is not None and tokens.device.type in self.by_length_devices:
            lengths = valid.sum(dim=1)
            trailing = bool((valid == (torch.arange(valid.shape[1], device=valid.device) < lengths[:, None])).all())
            if trailing and int(lengths.min()) < valid.shape[1]:
                return self._by_length(tokens, lengths)
        return self._forward(tokens, valid)

    def _by_length(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sets padded at the end, run one length at a time at their own width: the transformer never computes
        padded tokens (every even prefix 2..16 of a set, padded to 16, is 44 % padding). The same function as the
        masked call (padded keys are never attended to and get no mass; LayerNorm and the MLPs act per token), up
        to float rounding and the drop-path draws. Padded positions: zero assignment, zero keys. CPU only: there the
        cost is the arithmetic, while on a GPU these small kernels are launch-bound and the lengths' host reads stall
        the stream (benchmark row ``caface_paths``)."""
        b, n, d = tokens.shape
        assignment = tokens.new_zeros(b, self.centres.shape[0], n)
        keys = tokens.new_zeros(b, n, d)
        for length in torch.unique(lengths).tolist():
            rows = torch.nonzero(lengths == length).flatten()
            a, k = self._forward(tokens[rows, :length])
            assignment = assignment.index_copy(0, rows, torch.nn.functional.pad(a, (0, n - length)))
            keys = keys.index_copy(0, rows, torch.nn.functional.pad(k, (0, 0, 0, n - length)))
        return assignment, keys

    def _forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = tokens.shape
        centres = self.centres.unsqueeze(0).expand(b, -1, -1)  # (B, M, d)
        x = torch.cat([tokens, centres], dim=1)  # (B, N+M, d)
        bias = None
        if valid is not None:
            # Padded items are never attended to; the M centre tokens always are, so no row is all −inf.
            keep = torch.cat([valid, valid.new_ones(b, centres.shape[1])], dim=1)  # (B, N+M)
            bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, float("-inf"))
            bias = bias[:, None, None, :]  # (B, 1, 1, N+M), broadcast over heads and queries
        for block in self.blocks:
            x = block(x, bias)
        keys = self.norm_keys(x[:, :n])  # (B, N, d): LN(updated S); the updated C is dropped
        q = self.query(self.norm_centres(self.centres))  # (M, d)
        logits = torch.einsum("md,bnd->bmn", q, self.key(keys)) * self.scale  # (B, M, N)
        assignment = logits.softmax(dim=1)  # column softmax: Σ_m A[:, m, t] = 1
        if valid is not None:
            assignment = assignment * valid.unsqueeze(1).to(assignment.dtype)  # padded items: no mass
        return assignment, keys


class GatedMixerBlock(nn.Module):
    """MLP-Mixer block with a learnable skip gate (init 1) on the token-mixing residual (reference layout).

    ``x ← g·x + TokenMLP(LN(x)ᵀ)ᵀ`` then ``x ← x + ChannelMLP(LN(x))``; one LayerNorm serves both.
    Token MLP: tokens → 2·tokens → tokens; channel MLP: channels → channels/2 → channels; GELU.
    """

    def __init__(self, tokens: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=LN_EPS)
        self.token_mlp = Mlp(tokens, 2 * tokens)
        self.channel_mlp = Mlp(channels, channels // 2)
        self.gate = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, M, channels)
        x = self.gate * x + self.token_mlp(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm(x))


class AggregationNetwork(nn.Module):
    """AGN: centres ``C`` (M, d), ``S'`` (B, M, d), ``F'`` (B, M, D) → (``Σ_m P_m ⊙ F'_m`` (B, D), ``P`` (B, M, D)).

    ``P = softmax over M of MLP(Mixer^depth([C; S']))``: per channel, the cluster weights sum to 1.
    """

    def __init__(self, dim: int, num_clusters: int, feature_dim: int, depth: int) -> None:
        super().__init__()
        self.mixer = nn.Sequential(*(GatedMixerBlock(num_clusters, 2 * dim) for _ in range(depth)))
        self.head = Mlp(2 * dim, 2 * dim, feature_dim)

    def forward(
        self, centres: torch.Tensor, cluster_styles: torch.Tensor, cluster_features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.cat([centres.unsqueeze(0).expand_as(cluster_styles), cluster_styles], dim=-1)  # (B, M, 2d)
        weights = self.head(self.mixer(tokens)).softmax(dim=1)  # (B, M, D)
        return (weights * cluster_features).sum(dim=1), weights


class FusionState(NamedTuple):
    """Streaming memory of a batch of B sets: O(M·(D + d)) per set, whatever the number of items seen."""

    count: torch.Tensor  # c̄ (B, M): Σ of the assignment mass each cluster received
    features: torch.Tensor  # F̄' (B, M, D)
    styles: torch.Tensor  # S̄' (B, M, d)


class ClusterOutput(NamedTuple):
    """The CN's intermediates for one call."""

    count: torch.Tensor  # c (B, M) = Σ_t A
    features: torch.Tensor  # F' (B, M, D) = Â·F_unit
    styles: torch.Tensor  # S' (B, M, d) = Â·LN(S)
    assignment: torch.Tensor  # A (B, M, N), columns sum to 1 (0 for padded items)


class CAFace(nn.Module):
    """Cluster-and-aggregate fusion of a set of (feature, style) pairs into one unit-norm template.

    ``CAFace()`` is the paper's configuration: 512-d features, styles (…, 384, 2), 4 clusters, key tokens
    of 64 + 64 = 128, a 2-block 8-head CN transformer and 2 mixer blocks (0.79M parameters).
    """

    def __init__(
        self,
        feature_dim: int = 512,
        style_dim: int = 384,
        num_clusters: int = 4,
        style_embed_dim: int = 64,
        norm_embed_dim: int = 64,
        depth: int = 2,
        heads: int = 8,
        mlp_ratio: float = 4.0,
        mixer_depth: int = 2,
        drop_path_rate: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value in (
            ("feature_dim", feature_dim), ("style_dim", style_dim), ("num_clusters", num_clusters),
            ("style_embed_dim", style_embed_dim), ("norm_embed_dim", norm_embed_dim), ("depth", depth),
            ("heads", heads), ("mixer_depth", mixer_depth),
        ):
            _positive_int(name, value)
        if norm_embed_dim % 2:
            raise ConfigError(f"CAFace norm_embed_dim must be even (sin/cos pairs), got {norm_embed_dim}")
        dim = style_embed_dim + norm_embed_dim
        if dim % heads:
            raise ConfigError(
                f"CAFace key tokens have style_embed_dim + norm_embed_dim = {dim} channels, not divisible by "
                f"heads = {heads}; change one of them"
            )
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
            raise ConfigError(f"CAFace mlp_ratio must be a positive number, got {mlp_ratio!r}")
        if isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float)) or not 0 <= drop_path_rate < 1:
            raise ConfigError(f"CAFace drop_path_rate must be in [0, 1), got {drop_path_rate!r}")
        self.feature_dim = feature_dim
        self.style_dim = style_dim
        self.num_clusters = num_clusters
        self.style_embed_dim = style_embed_dim
        self.norm_embed_dim = norm_embed_dim
        self.dim = dim
        self.depth = depth
        self.heads = heads
        self.mlp_ratio = float(mlp_ratio)
        self.mixer_depth = mixer_depth
        self.drop_path_rate = float(drop_path_rate)

        self.sim = StyleInputMaker(style_dim, style_embed_dim, norm_embed_dim)
        self.cn = ClusterNetwork(dim, num_clusters, depth, heads, self.mlp_ratio, self.drop_path_rate)
        self.agn = AggregationNetwork(dim, num_clusters, feature_dim, mixer_depth)
        # reference: CN and AGN Linear layers truncated normal std 0.02, biases 0; LayerNorm 1/0
        self.cn.apply(init_transformer_weights)
        self.agn.apply(init_transformer_weights)

    @property
    def config(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this model (``CAFace(**model.config)``)."""
        return {
            "feature_dim": self.feature_dim, "style_dim": self.style_dim, "num_clusters": self.num_clusters,
            "style_embed_dim": self.style_embed_dim, "norm_embed_dim": self.norm_embed_dim, "depth": self.depth,
            "heads": self.heads, "mlp_ratio": self.mlp_ratio, "mixer_depth": self.mixer_depth,
            "drop_path_rate": self.drop_path_rate,
        }

    # ---------------------------------------------------------------- inputs
    def _check(
        self, features: torch.Tensor, styles: torch.Tensor, mask: torch.Tensor | None, *, allow_empty_rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validate and cast; padded items are zeroed so that garbage there cannot leak (0·NaN = NaN)."""
        if not isinstance(features, torch.Tensor) or not isinstance(styles, torch.Tensor):
            raise DataError(
                f"features and styles must be torch tensors, got {type(features).__name__} and {type(styles).__name__}"
            )
        if not features.is_floating_point() or not styles.is_floating_point():
            raise DataError(f"features and styles must be floating point, got {features.dtype} and {styles.dtype}")
        if features.ndim != 3:
            raise DataError(
                f"features must have shape (B, N, {self.feature_dim}) (sets of N items), got {tuple(features.shape)}; "
                "add a batch axis with features[None] for a single set"
            )
        b, n, dim = features.shape
        if dim != self.feature_dim:
            raise DataError(
                f"features have {dim} channels but this CAFace was built with feature_dim={self.feature_dim}; use the "
                "backbone the fusion model was trained on"
            )
        if n == 0 or b == 0:
            raise DataError(f"features {tuple(features.shape)} hold no items; every set needs at least one image")
        if tuple(styles.shape) != (b, n, self.style_dim, 2):
            raise DataError(
                f"styles must have shape (B, N, style_dim, 2) = {(b, n, self.style_dim, 2)} (per-channel mean and std "
                f"of the backbone's style stages), got {tuple(styles.shape)}"
            )
        dtype = self.cn.centres.dtype
        features, styles = features.to(dtype), styles.to(dtype)
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (b, n):
                raise DataError(
                    f"mask must be a bool tensor of shape (B, N) = {(b, n)} (True = real item), got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}"
                )
            mask = mask.to(features.device)
            empty = torch.nonzero(~mask.any(dim=1)).flatten()
            if not allow_empty_rows and empty.numel():
                raise DataError(
                    f"sets {empty[:5].tolist()} of the batch have no items (mask all False); drop empty sets first"
                )
            features = features.masked_fill(~mask[..., None], 0.0)
            styles = styles.masked_fill(~mask[..., None, None], 0.0)
        bad = ~(torch.isfinite(features).all(dim=-1) & torch.isfinite(styles).flatten(2).all(dim=-1))  # (B, N)
        if bad.any():
            s, t = (int(i) for i in torch.nonzero(bad)[0])
            what = "feature" if not torch.isfinite(features[s, t]).all() else "style"
            raise DataError(
                f"non-finite (NaN or inf) {what} at set {s}, item {t} ({int(bad.sum())} such items); drop or re-extract "
                "those images before fusion"
            )
        if self.training:
            items = int(mask.sum()) if mask is not None else b * n
            if items < 2:
                raise DataError(
                    f"train-mode CAFace got {items} item(s) in this call, but its BatchNorms need at least 2; call "
                    "model.eval() for inference or give the training step more items"
                )
        return features, styles, mask

    def _embed(
        self, features: torch.Tensor, styles: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SIM + CN on checked inputs → (assignment A (B, M, N), F_unit (B, N, D), LN(S) (B, N, d))."""
        b, n, _ = features.shape
        norms = features.norm(dim=-1)  # (B, N)
        if mask is None:
            tokens = self.sim(norms.reshape(-1), styles.reshape(b * n, self.style_dim, 2)).reshape(b, n, self.dim)
        else:
            # Only real items enter the SIM, so padding never touches the BatchNorm statistics.
            flat = self.sim(norms[mask], styles[mask])  # (K, d)
            tokens = flat.new_zeros(b, n, self.dim).masked_scatter(mask[..., None], flat)
        assignment, keys = self.cn(tokens, mask)  # (B, M, N), (B, N, d)
        return assignment, F.normalize(features, dim=-1), keys  # zero feature rows stay zero

    # ---------------------------------------------------------------- public API
    def cluster(self, features: torch.Tensor, styles: torch.Tensor, mask: torch.Tensor | None = None) -> ClusterOutput:
        """CN intermediates of sets ``features`` (B, N, D), ``styles`` (B, N, style_dim, 2): c, F', S', A."""
        features, styles, mask = self._check(features, styles, mask, allow_empty_rows=False)
        assignment, units, keys = self._embed(features, styles, mask)
        cluster_features, count = assign_average(assignment, units)
        cluster_styles, _ = assign_average(assignment, keys)
        return ClusterOutput(count, cluster_features, cluster_styles, assignment)

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> FusionState:
        """Empty memory for ``batch_size`` sets: zero counts, zero cluster features and styles."""
        _positive_int("batch_size", batch_size)
        ref = self.cn.centres
        device = ref.device if device is None else torch.device(device)
        m = self.num_clusters
        return FusionState(
            torch.zeros(batch_size, m, device=device, dtype=ref.dtype),
            torch.zeros(batch_size, m, self.feature_dim, device=device, dtype=ref.dtype),
            torch.zeros(batch_size, m, self.dim, device=device, dtype=ref.dtype),
        )

    def _check_state(self, state: FusionState) -> tuple[FusionState, int]:
        """Validate a memory (any 3-tuple of tensors is accepted) → (FusionState, B)."""
        parts = tuple(state) if isinstance(state, tuple) else ()
        if len(parts) != 3 or not all(isinstance(t, torch.Tensor) for t in parts):
            raise DataError("state must be the (count, features, styles) FusionState from init_state/update")
        count, feats, sty = parts
        b = count.shape[0] if count.ndim == 2 else -1
        m = self.num_clusters
        if (tuple(count.shape), tuple(feats.shape), tuple(sty.shape)) != ((b, m), (b, m, self.feature_dim), (b, m, self.dim)):
            raise DataError(
                f"state shapes {tuple(count.shape)}, {tuple(feats.shape)}, {tuple(sty.shape)} do not fit this CAFace "
                f"(B, {m}), (B, {m}, {self.feature_dim}), (B, {m}, {self.dim}); start from model.init_state(B)"
            )
        return FusionState(count, feats, sty), b

    def update(
        self, state: FusionState, features: torch.Tensor, styles: torch.Tensor, mask: torch.Tensor | None = None
    ) -> FusionState:
        """Absorb one chunk (B, N', D) + (B, N', style_dim, 2) into the memory (paper Eq. 8).

        ``c̄ ← c̄ + c``; ``F̄' ← (max(1, c̄)·F̄' + A·F_unit) / max(1, c̄ + c)``, the same for ``S̄'`` with
        ``A·LN(S)``; divisors detached. With ``mask``, a set may have no items in this chunk (it stays as is).
        """
        state, b = self._check_state(state)
        features, styles, mask = self._check(features, styles, mask, allow_empty_rows=True)
        if features.shape[0] != b:
            raise DataError(f"the state holds {b} sets but this chunk has {features.shape[0]}; keep one state per batch")
        assignment, units, keys = self._embed(features, styles, mask)
        count = state.count + assignment.sum(dim=-1)  # (B, M)
        old = state.count.detach().clamp_min(1.0).unsqueeze(-1)  # (B, M, 1): undoes the last division
        new = count.detach().clamp_min(1.0).unsqueeze(-1)
        return FusionState(
            count,
            (old * state.features + assignment @ units) / new,  # (B, M, D)
            (old * state.styles + assignment @ keys) / new,  # (B, M, d)
        )

    def aggregate(self, state: FusionState) -> tuple[torch.Tensor, torch.Tensor]:
        """AGN on the memory → (unit-norm templates (B, D), cluster weights P (B, M, D))."""
        state, _ = self._check_state(state)
        empty = torch.nonzero(state.count.sum(dim=-1) <= 0).flatten()
        if empty.numel():
            raise DataError(
                f"sets {empty[:5].tolist()} of this state saw no items; call model.update(state, ...) with at least "
                "one item per set before fuse()"
            )
        fused, weights = self.agn(self.cn.centres, state.styles, state.features)
        return F.normalize(fused, dim=-1), weights

    def fuse(self, state: FusionState) -> torch.Tensor:
        """Unit-norm templates (B, D) from the memory."""
        return self.aggregate(state)[0]

    def forward(self, features: torch.Tensor, styles: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sets (B, N, D) + styles (B, N, style_dim, 2) [+ mask (B, N)] → unit-norm templates (B, D), in one call."""
        out = self.cluster(features, styles, mask)
        return self.fuse(FusionState(out.count, out.features, out.styles))


def save_caface(model: CAFace, model_dir: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to ``model_dir`` (``model.safetensors`` + ``config.json`` with its kwargs), atomically."""
    if not isinstance(model, CAFace):
        raise ConfigError(f"save_caface needs a CAFace model, got {type(model).__name__}")
    config = {"format": FORMAT, "model": "caface", "kwargs": model.config, "extra": dict(extra or {})}
    return write_model_dir(model_dir, model, config, what="CAFace")


def load_caface(model_dir: str | os.PathLike) -> CAFace:
    """Rebuild the CAFace saved by ``save_caface`` in ``model_dir``; returned in eval mode."""
    config = read_model_config(model_dir, what="CAFace")
    config_path = Path(model_dir) / CONFIG
    if config.get("model") != "caface" or not isinstance(config.get("kwargs"), dict):
        raise DataError(f"{config_path} is not a CAFace config (needs \"model\": \"caface\" and kwargs); re-save it")
    try:
        model = CAFace(**config["kwargs"])
    except (ConfigError, TypeError) as exc:
        raise DataError(f"{config_path}: cannot build CAFace from its kwargs {config['kwargs']}: {exc}") from exc
    return load_weights_into(model, model_dir, what=f"CAFace({config['kwargs']})")


__all__ = [
    "CAFace",
    "AggregationNetwork",
    "ClusterNetwork",
    "ClusterOutput",
    "FusionState",
    "GatedMixerBlock",
    "StyleInputMaker",
    "assign_average",
    "load_caface",
    "save_caface",
    "sinusoid_table",
]
