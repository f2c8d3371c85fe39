"""``FusionStream``: one set's template fused from frames that arrive a chunk at a time, in memory bounded by the
chunk (running sums for the baselines and the quality oracle, the CAFace memory for ``caface``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ml.errors import ConfigError, DataError
from ml.fusion.sets.fusers import (
    STREAM_METHODS, _caface_styles, _check_caface, _check_features, _landmark_score_weights, _positive_int,
    _quality_weights,
)
from ml.fusion.caface import CAFace

log = logging.getLogger(__name__)


class FusionStream:
    """One set's template fused from frames that arrive a chunk at a time, in memory that does not grow with the
    set (IJB-S probes of tens of thousands of frames): between calls it keeps fewer than ``chunk_size`` frames.

    The state per ``method`` (D = feature size; the formulas are ``fuse_templates``'s, see the module docstring):

    - ``average``: ``Σ_i f̄_i`` (D,) in float64; ``norm_weighted``: ``Σ_i f_i`` (D,);
    - ``landmark_score``: ``Σ_i w_i·f̄_i`` (D,), ``Σ_i w_i`` and ``Σ_i f̄_i`` (the fallback when every weight is
      0), ``w_i = d_i·s_i`` (KP-RPE supp. Eq. 17–18) from ``landmarks`` and ``face_scores``;
    - ``quality_oracle``: the same sums with ``w_i = q_i``, the renderer's true quality of each frame, passed as
      ``quality`` with its chunk (a headroom reference, not a method: only a renderer knows ``q_i``);
    - ``caface``: the CAFace memory ``(c̄, F̄', S̄')`` of ``init_state``/``update`` (O(M·(D + d)), paper Eq. 8) plus
      a buffer of fewer than ``chunk_size`` frames, so the chunks absorbed are frames [0, C), [C, 2C), … however
      ``update`` is sliced.

    ``template()`` equals ``fuse_templates(method, <every frame so far>, chunk_size=chunk_size)`` up to float
    rounding (the same float64 sums; CAFace over the same chunks) and leaves the state as it is, so the templates
    of a probe's prefixes are read on the way. Bad input raises as in ``fuse_templates``.
    """

    def __init__(
        self,
        method: str,
        *,
        model: CAFace | None = None,
        image_size: float | None = None,
        chunk_size: int = 64,
        h: float = 0.2,
    ) -> None:
        if method not in STREAM_METHODS:
            raise ConfigError(f"unknown fusion method {method!r}; FusionStream fuses {', '.join(STREAM_METHODS)}")
        self.method = method
        self.model = _check_caface(model) if method == "caface" else None
        self.image_size = image_size
        self.chunk_size = _positive_int(chunk_size, "chunk_size")
        self.h = h
        self.frames = 0
        self._total: np.ndarray | None = None  # (D,) float64: Σ f̄, Σ f or Σ w·f̄
        self._units: np.ndarray | None = None  # (D,) float64: Σ f̄ (landmark_score's and quality_oracle's fallback)
        self._weight = 0.0  # Σ w (landmark_score, quality_oracle)
        self._state: Any = None  # CAFace FusionState of the chunks absorbed
        self._buffer: list[tuple[np.ndarray, np.ndarray]] = []  # CAFace frames not yet absorbed, < chunk_size
        self._buffered = 0

    def update(
        self,
        features: np.ndarray | torch.Tensor,
        *,
        styles: np.ndarray | torch.Tensor | None = None,
        landmarks: np.ndarray | torch.Tensor | None = None,
        face_scores: np.ndarray | torch.Tensor | None = None,
        quality: np.ndarray | torch.Tensor | None = None,
    ) -> FusionStream:
        """Absorb the next frames: ``features`` (n, D) and what the method needs (``styles`` (n, style_dim, 2) for
        ``caface``; ``landmarks`` (n, 5, 2) pixels and optional ``face_scores`` (n,) for ``landmark_score``;
        ``quality`` (n,) ≥ 0, the renderer's true quality, for ``quality_oracle``)."""
        feats = _check_features(features)
        n, d = feats.shape
        dim = self.model.feature_dim if self.model is not None else (None if self._total is None else self._total.size)
        if dim is not None and d != dim:
            raise DataError(f"features have {d} channels but this stream fuses {dim}-d features; use one backbone")
        if self.method == "caface":
            self._update_caface(feats, styles)
        else:
            units = F.normalize(torch.from_numpy(feats), dim=1)  # (n, D) float32, as fuse_templates
            if self.method == "average":
                part = units.double().sum(dim=0)
            elif self.method == "norm_weighted":
                part = torch.from_numpy(feats).double().sum(dim=0)
            else:
                if self.method == "landmark_score":
                    weights = _landmark_score_weights(landmarks, face_scores, n, self.image_size, self.h)  # (n,)
                else:
                    weights = _quality_weights(quality, n, " with every update")
                part = (weights[:, None] * units).double().sum(dim=0)
                self._weight += float(weights.double().sum())
                unit_sum = units.double().sum(dim=0).numpy()
                self._units = unit_sum if self._units is None else self._units + unit_sum
            self._total = part.numpy() if self._total is None else self._total + part.numpy()
        self.frames += n
        return self

    def _update_caface(self, feats: np.ndarray, styles: Any) -> None:
        assert self.model is not None  # checked in __init__
        self._buffer.append((feats, _caface_styles(self.model, feats, styles)))
        self._buffered += feats.shape[0]
        if self._buffered < self.chunk_size:
            return
        all_feats = np.concatenate([f for f, _ in self._buffer])
        all_styles = np.concatenate([s for _, s in self._buffer])
        full = (all_feats.shape[0] // self.chunk_size) * self.chunk_size
        for lo in range(0, full, self.chunk_size):
            self._state = self._absorb(self._state, all_feats[lo : lo + self.chunk_size],
                                       all_styles[lo : lo + self.chunk_size])
        rest = all_feats.shape[0] - full
        self._buffer = [(all_feats[full:].copy(), all_styles[full:].copy())] if rest else []
        self._buffered = rest

    @torch.no_grad()
    def _absorb(self, state: Any, feats: np.ndarray, styles: np.ndarray) -> Any:
        """The CAFace memory after one chunk (eval mode, the model's mode restored)."""
        model = self.model
        assert model is not None
        device = model.cn.centres.device
        was_training = model.training
        model.eval()
        try:
            if state is None:
                state = model.init_state(1, device=device)
            return model.update(state, torch.from_numpy(feats)[None].to(device), torch.from_numpy(styles)[None].to(device))
        finally:
            model.train(was_training)

    @torch.no_grad()
    def template(self) -> np.ndarray:
        """The unit-norm template (D,) float32 of every frame so far; the state is unchanged."""
        if self.frames == 0:
            raise DataError(f"the {self.method} stream has no frames yet; call update() with at least one frame first")
        if self.method == "caface":
            model = self.model
            assert model is not None
            state = self._state
            if self._buffer:  # the last, partial chunk, absorbed into a copy of the memory
                state = self._absorb(state, np.concatenate([f for f, _ in self._buffer]),
                                     np.concatenate([s for _, s in self._buffer]))
            was_training = model.training
            model.eval()
            try:
                fused = model.fuse(state)[0].double().cpu()
            finally:
                model.train(was_training)
        else:
            assert self._total is not None
            fused = torch.from_numpy(self._total)
            floor = {"landmark_score": 0.0, "quality_oracle": 1e-12}.get(self.method)  # as fuse_templates
            if floor is not None and self._weight <= floor:
                log.warning("the %s stream has all weights 0 after %d frames; using the plain average", self.method,
                            self.frames)
                assert self._units is not None
                fused = torch.from_numpy(self._units)
        norm = float(fused.norm())
        if norm <= 1e-12:
            raise DataError(
                f"the {self.method} stream fuses to the zero vector after {self.frames} frames: its features cancel out"
            )
        return (fused / norm).float().numpy()

    def state_nbytes(self) -> int:
        """Bytes the stream holds now (sums, CAFace memory, buffered frames): bounded by the chunk, not the set."""
        total = sum(a.nbytes for a in (self._total, self._units) if a is not None)
        if self._state is not None:
            total += sum(t.numel() * t.element_size() for t in self._state)
        return total + sum(f.nbytes + s.nbytes for f, s in self._buffer)
