"""ViT with KeyPoint Relative Position Embedding (KP-RPE, Kim et al., CVPR 2024): a landmark-dependent attention bias::

    logit[l, b, h, i, j] = q_i·k_j/√d + E[l, b, h, i, bucket(i, j)],   E = f(D) as (L, B, H, T, 49)
    D_i = concat_j (p_i − k_j) ∈ R^10   (patch centre p_i, landmark k_j, both divided by the image side)

``f`` is one Linear (``keypoint_map="linear"``, the paper's ``rel_keypoint_splithead_unshared``) or
Linear → ReLU → LayerNorm → Linear (``"mlp"``, the reference's ``rel_keypoint_unshared_v2`` with split heads).
A Linear is affine in ``D_i``, so its keypoint term ``−W·k`` is one offset-bucket table per face shared by
every query token: it can reweight offsets (a face seen larger or turned) but not make a token attend where a
shifted feature now lies. The MLP's term depends on where each query token sits relative to the landmarks.

``bucket`` quantises the grid offset of tokens i, j with iRPE's "product" method (:func:`relative_position_buckets`).
The Linear is zero-initialised, so a fresh model computes exactly what the plain ViT computes. Keypoints enter as
``(B, 5, 2)`` pixel (x, y) in ArcFace order, pixel centres at integer coordinates.

Differences from the reference (CVLface ``vit_kprpe``, ``rel_keypoint_splithead_unshared``):

- Patch centres sit where the patches are, ``(c·P + (P − 1)/2)/S``, not at ``(c + 0.5)/grid`` (differs at patch 9).
- Token masking works (the bias is gathered to the kept tokens); the reference asserts ``mask_ratio == 0``.
- The bias is added to ``q·k/√d`` (no context product); bad keypoints raise ``DataError``, with no fallback.
- Only the product method; ``return_styles`` gives CAFace styles.
- ``fr.keypoint_lr_scale`` can give the keypoint map its own learning rate (default 1, as in the reference).
- ``fr.keypoint_map: mlp`` keeps one table per layer and head (the reference's MLP variant shares one over heads).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ml.errors import ConfigError, DataError
from ml.fr.backbones.vit import INPUT_CONTRACT as VIT_INPUT_CONTRACT
from ml.fr.backbones.vit import SIZES, ViT

NUM_KEYPOINTS = 5
KEYPOINT_MAPS = ("linear", "mlp")
KEYPOINT_HIDDEN = 256  # the MLP map's width, as the reference's ``rel_keypoint_unshared_v2``
# iRPE "product" defaults used by KP-RPE (ratio 1.9): buckets per axis 2·⌊β⌋ + 1 = 7, 49 in all.
ALPHA, BETA, GAMMA = 1.9, 3.8, 15.2

# The plain ViT contract plus the landmarks every forward needs.
INPUT_CONTRACT: dict[str, Any] = {
    **VIT_INPUT_CONTRACT,
    "needs_keypoints": True,
    "keypoints": "(B, 5, 2) float pixel (x, y) in the input image, pixel centres at integer "
    "coordinates; ArcFace order: image-left eye, image-right eye, nose tip, image-left mouth corner, "
    "image-right mouth corner",
}


def piecewise_index(delta: torch.Tensor, alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA) -> torch.Tensor:
    """iRPE piecewise index (Wu et al. 2021, Eq. 18) of offsets ``delta``, as int64 in [−⌊β⌋, ⌊β⌋].

    ``g(Δ) = round(Δ)`` if ``|Δ| ≤ α`` else ``sign(Δ)·min(round(α + ln(|Δ|/α)/ln(γ/α)·(β − α)), β)``,
    truncated to an integer (so the cap is ⌊β⌋). ``round`` is half-to-even (``torch.round``), which is
    odd-symmetric: ``g(−Δ) = −g(Δ)``. Written with ``torch.where`` (no boolean-mask assignment).
    """
    d = delta.to(torch.float32)  # exact for the integer offsets of a grid
    mag = d.abs()
    far = alpha + torch.log(mag.clamp(min=alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    g = torch.sign(d) * torch.round(torch.where(mag <= alpha, mag, far))
    cap = math.floor(beta)
    return g.clamp(-cap, cap).to(torch.long)


def relative_position_buckets(
    grid_size: int, alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA
) -> torch.Tensor:
    """Bucket of every token pair on a ``grid_size``² patch grid, ``(grid², grid²)`` int64.

    Token ``i`` sits at row ``i // grid``, column ``i % grid`` (the row-major order of
    ``PatchEmbed``). With ``Δr = row_i − row_j``, ``Δc = col_i − col_j`` and ``n = ⌊β⌋``:
    ``bucket = (g(Δr) + n)·(2n + 1) + (g(Δc) + n)`` (iRPE "product"), in ``[0, (2n + 1)²)`` — with the
    defaults ``(g(Δr) + 3)·7 + (g(Δc) + 3) ∈ [0, 49)``; the diagonal is the centre bucket 24.
    """
    if not isinstance(grid_size, int) or isinstance(grid_size, bool) or grid_size < 1:
        raise ConfigError(f"relative_position_buckets: grid_size must be a positive integer, got {grid_size!r}")
    if not 0 < alpha < beta < gamma or beta < 1:
        raise ConfigError(
            f"relative_position_buckets needs 0 < alpha < beta < gamma and beta ≥ 1, got "
            f"alpha={alpha}, beta={beta}, gamma={gamma}"
        )
    n = math.floor(beta)
    pos = torch.arange(grid_size * grid_size)
    row, col = pos // grid_size, pos % grid_size
    g_r = piecewise_index(row[:, None] - row[None, :], alpha, beta, gamma)  # (T, T)
    g_c = piecewise_index(col[:, None] - col[None, :], alpha, beta, gamma)
    return (g_r + n) * (2 * n + 1) + (g_c + n)


def num_buckets(beta: float = BETA) -> int:
    """Number of product buckets, ``(2⌊β⌋ + 1)²`` (49 for β = 3.8)."""
    return (2 * math.floor(beta) + 1) ** 2


def patch_centres(img_size: int, patch_size: int) -> torch.Tensor:
    """Normalised ``(x, y)`` centres of the patches in token order, ``(grid², 2)`` in (0, 1).

    Pixel centres at integer coordinates: patch column ``c`` spans pixels ``c·P … c·P + P − 1`` and is
    centred at ``c·P + (P − 1)/2``; divided by ``img_size`` like the keypoints.
    """
    grid = img_size // patch_size
    centre = (torch.arange(grid, dtype=torch.float32) * patch_size + (patch_size - 1) / 2) / img_size
    ys, xs = torch.meshgrid(centre, centre, indexing="ij")  # row-major, like PatchEmbed's tokens
    return torch.stack([xs, ys], dim=-1).reshape(grid * grid, 2)


class KPRPE(nn.Module):
    """Keypoints → per-layer, per-head attention biases over the patch grid.

    ``tables(k)``: ``(L, B, H, T, NB)`` with ``E = Linear(concat_j (p_i − k_j))``, built from ``parts(k)``, its
    face-independent and token-independent terms (the model builds one layer's table at a time from them);
    ``forward(k)``: the full biases ``(L, B, H, T, T)``, ``bias[l,b,h,i,j] = E[l,b,h,i,bucket(i,j)]``.
    The Linear starts at zero, so every bias starts at exactly 0.
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        depth: int,
        heads: int,
        num_keypoints: int = NUM_KEYPOINTS,
        alpha: float = ALPHA,
        beta: float = BETA,
        gamma: float = GAMMA,
        keypoint_map: str = "linear",
        hidden: int = KEYPOINT_HIDDEN,
    ) -> None:
        super().__init__()
        if keypoint_map not in KEYPOINT_MAPS:
            raise ConfigError(f"fr.keypoint_map {keypoint_map!r} is not one of {list(KEYPOINT_MAPS)}")
        self.keypoint_map = keypoint_map
        self.depth = depth
        self.heads = heads
        self.num_keypoints = num_keypoints
        self.num_buckets = num_buckets(beta)
        grid = img_size // patch_size
        self.num_tokens = grid * grid
        # Derived constants, not weights: non-persistent so a KP-RPE state_dict is the plain ViT's
        # plus ``kprpe.linear.*``.
        self.register_buffer("centres", patch_centres(img_size, patch_size), persistent=False)  # (T, 2)
        buckets = relative_position_buckets(grid, alpha, beta, gamma)  # (T, T)
        self.register_buffer("buckets", buckets, persistent=False)
        width = 2 * num_keypoints
        if keypoint_map == "mlp":  # PyTorch's default init for the hidden layer, as in the reference
            self.hidden = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.LayerNorm(hidden))
            width = hidden
        self.linear = nn.Linear(width, self.num_buckets * heads * depth)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def relative_keypoints(self, keypoints: torch.Tensor) -> torch.Tensor:
        """Normalised keypoints ``(B, K, 2)`` → ``D`` ``(B, T, 2K)``, ``D_i = concat_j (p_i − k_j)``."""
        diff = self.centres[None, :, None, :] - keypoints[:, None, :, :]  # (B, T, K, 2)
        return diff.flatten(2)

    def parts(self, keypoints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised keypoints ``(B, K, 2)`` → the two terms of the bucket tables, ``table = static − per_face``.

        The Linear is affine in ``D_i = concat_j (p_i − k_j)``, so ``E = (W·P_i + b) − W·K``: ``static``
        ``(L, H, T, NB)`` is the same for every face and ``per_face`` ``(L, B, H, NB)`` the same for every query
        token. Building a layer's ``(B, H, T, NB)`` table from them when it is needed replaces one
        ``(B, T, L·H·NB)`` Linear output (173 MB for ``vit_s`` at batch 64) by two small products.
        """
        w, b = self.linear.weight, self.linear.bias
        p = self.centres.repeat(1, self.num_keypoints)  # (T, 2K): concat_j p_i, in D's layout
        static = torch.addmm(b, p, w.t())  # (T, L·H·NB), layer-major
        per_face = keypoints.to(w.dtype).flatten(1) @ w.t()  # (B, L·H·NB)
        shape = (self.depth, self.heads, self.num_buckets)
        return (static.view(p.shape[0], *shape).permute(1, 2, 0, 3),
                per_face.view(keypoints.shape[0], *shape).permute(1, 0, 2, 3))

    @staticmethod
    def layer_table(static: torch.Tensor, per_face: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s bucket table ``(B, H, T, NB)`` from :meth:`parts`."""
        return static[layer] - per_face[layer][:, :, None]

    def prepare(self, keypoints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What :meth:`table` builds every layer's table from: :meth:`parts` for the Linear map; for the MLP, its
        hidden features of ``D`` ``(B, T, hidden)``."""
        if self.keypoint_map == "linear":
            return self.parts(keypoints)
        return (self.hidden(self.relative_keypoints(keypoints.to(self.linear.weight.dtype))),)

    def table(self, state: tuple[torch.Tensor, ...], layer: int) -> torch.Tensor:
        """Layer ``layer``'s bucket table ``(B, H, T, NB)`` from :meth:`prepare`'s ``state``."""
        if self.keypoint_map == "linear":
            return self.layer_table(*state, layer)
        rows = self.heads * self.num_buckets  # the output is layer-major, as in :meth:`parts`
        w = self.linear.weight[layer * rows : (layer + 1) * rows]
        out = torch.nn.functional.linear(state[0], w, self.linear.bias[layer * rows : (layer + 1) * rows])
        b, t, _ = out.shape
        return out.view(b, t, self.heads, self.num_buckets).transpose(1, 2)

    def tables(self, keypoints: torch.Tensor) -> torch.Tensor:
        """Normalised keypoints ``(B, K, 2)`` → bucket tables ``(L, B, H, T, NB)``, ``E = f(D)``."""
        if self.keypoint_map == "linear":
            static, per_face = self.parts(keypoints)
            return static[:, None] - per_face[..., None, :]
        state = self.prepare(keypoints)
        return torch.stack([self.table(state, layer) for layer in range(self.depth)])

    def layer_bias(self, table: torch.Tensor) -> torch.Tensor:
        """One layer's table ``(B, H, T, NB)`` → bias ``(B, H, T, T)``: ``gather`` along the buckets.

        ``gather`` with the broadcast (stride-0) bucket index timed at least as fast as index_select,
        advanced indexing or a one-hot matmul on the CPU, and exports as ONNX GatherElements.
        """
        b, h, t, _ = table.shape
        return table.gather(3, self.buckets.expand(b, h, t, t))

    def masked_layer_bias(self, table: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Bias ``(B, H, T', T')`` among the kept tokens ``keep`` ``(B, T')`` only."""
        b, h, _, nb = table.shape
        t_keep = keep.shape[1]
        rows = table.gather(2, keep[:, None, :, None].expand(b, h, t_keep, nb))  # (B, H, T', NB)
        idx = self.buckets[keep[:, :, None], keep[:, None, :]]  # (B, T', T')
        return rows.gather(3, idx[:, None].expand(b, h, t_keep, t_keep))

    def forward(self, keypoints: torch.Tensor) -> torch.Tensor:
        """Normalised keypoints ``(B, K, 2)`` → biases ``(L, B, H, T, T)``; layer ``l`` adds ``[l]``."""
        state = self.prepare(keypoints)
        return torch.stack([self.layer_bias(self.table(state, layer)) for layer in range(self.depth)])


class KPRPEViT(ViT):
    """The plain face ViT whose attention logits get the KP-RPE bias of the image's 5 landmarks.

    ``forward(x, keypoints)``: images ``(B, 3, S, S)`` and pixel landmarks ``(B, 5, 2)`` →
    ``(B, embed_dim)``; ``forward(x, keypoints, return_styles=True)`` also returns the CAFace styles
    ``(B, style_dim, 2)`` of the ``style_layers`` blocks, exactly as ``ViT`` computes them (the blocks'
    outputs here already carry the keypoint bias). Keypoints are required; ``needs_keypoints`` lets
    training and evaluation code tell this backbone from the plain one.
    """

    needs_keypoints = True

    def __init__(self, keypoint_map: str = "linear", **vit_kwargs: Any) -> None:
        super().__init__(**vit_kwargs)
        self.patch_size = self.patch_embed.patch_size
        self.num_keypoints = NUM_KEYPOINTS
        self.kprpe = KPRPE(self.img_size, self.patch_size, self.depth, self.heads, NUM_KEYPOINTS,
                           keypoint_map=keypoint_map)

    @property
    def input_contract(self) -> dict[str, Any]:
        return {**INPUT_CONTRACT, "size": self.img_size, "embedding_dim": self.embed_dim, "style_dim": self.style_dim}

    def normalised_keypoints(self, keypoints: torch.Tensor | None, batch: int) -> torch.Tensor:
        """Check pixel landmarks ``(B, 5, 2)`` and divide them by the image size."""
        if keypoints is None:
            raise DataError(
                f"KP-RPE needs 5 landmarks per image: call the model as model(images, keypoints) with "
                f"keypoints of shape ({batch}, {self.num_keypoints}, 2) in pixel (x, y) of the "
                f"{self.img_size}×{self.img_size} input, ArcFace order; rows without landmarks must be "
                "dropped or given detected ones"
            )
        if not isinstance(keypoints, torch.Tensor) or not keypoints.is_floating_point():
            raise DataError(
                f"KP-RPE keypoints must be a float tensor of pixel (x, y), got {type(keypoints).__name__}"
                + (f" of dtype {keypoints.dtype}" if isinstance(keypoints, torch.Tensor) else "")
            )
        if keypoints.shape != (batch, self.num_keypoints, 2):
            raise DataError(
                f"KP-RPE keypoints must have shape ({batch}, {self.num_keypoints}, 2) (batch, landmark, "
                f"pixel x/y) to match the {batch} images, got {tuple(keypoints.shape)}"
            )
        return keypoints / self.img_size

    def forward_features(
        self, x: torch.Tensor, keypoints: torch.Tensor | None = None, return_styles: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Images ``(B, 3, S, S)`` + pixel keypoints ``(B, 5, 2)`` → normalised tokens ``(B, T, dim)``, and
        with ``return_styles`` the styles ``(B, style_dim, 2)`` of the style blocks (as ``ViT``).

        Same steps as ``ViT.forward_features``, but each layer's table and bias are built just before its
        block (one ``(B, H, T, T)`` tensor alive at a time instead of ``L``).
        """
        kp = self.normalised_keypoints(keypoints, x.shape[0])
        state = self.kprpe.prepare(kp)  # Linear: (L, H, T, NB), (L, B, H, NB); MLP: (B, T, hidden)
        x = self.patch_embed(x) + self.pos_embed  # (B, T, dim)
        b, t, d = x.shape
        keep = None
        if self.training and self.mask_ratio > 0:
            keep = self._random_keep(b, x.device)  # (B, T')
            x = x.gather(1, keep[..., None].expand(-1, -1, d))  # (B, T', dim)
        styles: list[torch.Tensor] | None = [] if return_styles else None
        for layer, block in enumerate(self.blocks):
            table = self.kprpe.table(state, layer)  # (B, H, T, NB)
            if keep is None:
                bias = self.kprpe.layer_bias(table)  # (B, H, T, T)
            else:
                bias = self.kprpe.masked_layer_bias(table, keep)  # (B, H, T', T')
            x = block(x, bias)
            self._tap(layer + 1, x, styles)  # 1-based block numbers; kept tokens only while masking
        tokens = self._unmask(self.norm(x), keep, t)
        return tokens if styles is None else (tokens, torch.cat(styles, dim=1))

    def forward(
        self, x: torch.Tensor, keypoints: torch.Tensor | None = None, return_styles: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(B, embed_dim)`` embeddings; with ``return_styles`` also the styles ``(B, style_dim, 2)``."""
        if not return_styles:
            return self.feature(self.forward_features(x, keypoints).flatten(1))  # (B, embed_dim)
        tokens, styles = self.forward_features(x, keypoints, return_styles=True)
        return self.feature(tokens.flatten(1)), styles


def _variant(name: str, overrides: dict[str, Any]) -> KPRPEViT:
    return KPRPEViT(**{**SIZES[name], **overrides})


# Same sizes as the plain variants (vit.SIZES).
def vit_tiny_kprpe(**overrides: Any) -> KPRPEViT:
    """``vit_tiny`` + KP-RPE: 64 px, patch 8 (64 tokens), dim 128, depth 4, 128-d."""
    return _variant("vit_tiny", overrides)


def vit_t_kprpe(**overrides: Any) -> KPRPEViT:
    """``vit_t`` + KP-RPE: 112 px, patch 9 (144 tokens), dim 256, depth 12, 8 heads."""
    return _variant("vit_t", overrides)


def vit_s_kprpe(**overrides: Any) -> KPRPEViT:
    """``vit_s`` + KP-RPE: 112 px, patch 9, dim 512, depth 12, 8 heads."""
    return _variant("vit_s", overrides)


def vit_b_kprpe(**overrides: Any) -> KPRPEViT:
    """``vit_b`` + KP-RPE: 112 px, patch 9, dim 512, depth 24, 8 heads."""
    return _variant("vit_b", overrides)
