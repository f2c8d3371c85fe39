""":class:`ProceduralFaces`: identities and per-image or per-sequence nuisance drawn from their seeded streams,
each face placed on the template by a 5-point fit, drawn, degraded and returned with its exact landmarks."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from ml.data.procedural.config import (
    _BOOL_NUISANCE, _CLEAN_NUISANCE, _CX, _CY, _INT_NUISANCE, _SMOOTH_KEYS, _STREAM_SAMPLE, _STREAM_SEQUENCE,
    _TEMPLATE, FaceSample, ProceduralConfig, _rng, quality_score,
)
from ml.data.procedural.degrade import _degrade
from ml.data.procedural.draw import _draw_background, _draw_head
from ml.data.procedural.geometry import _View, _fit_similarity, _warp_points
from ml.data.procedural.identity import _canonical_landmarks, _Face, _sample_identity
from ml.data.procedural.occluders import _draw_occluders
from ml.errors import ConfigError


class ProceduralFaces:
    """Deterministic procedural face generator; identity indices are global for a seed."""

    def __init__(self, config: ProceduralConfig = ProceduralConfig(), seed: int = 0):
        if not isinstance(config, ProceduralConfig):
            raise ConfigError(f"ProceduralFaces: config must be a ProceduralConfig, got {type(config).__name__}.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"ProceduralFaces: seed must be a non-negative integer, got {seed!r}.")
        self.config = config
        self.seed = int(seed)
        self._faces: OrderedDict[int, _Face] = OrderedDict()
        self._cache_size = 2048

    # ---- identities

    def identity(self, identity: int) -> dict[str, float]:
        """The identity's parameters (plain floats), deterministic in (seed, identity)."""
        return dict(self._face(identity).p)

    def _face(self, identity: int) -> _Face:
        identity = self._check_index(identity, "identity")
        face = self._faces.get(identity)
        if face is None:
            face = _Face(_sample_identity(self.seed, identity))
            self._faces[identity] = face
            if len(self._faces) > self._cache_size:
                self._faces.popitem(last=False)
        else:
            self._faces.move_to_end(identity)
        return face

    @staticmethod
    def _check_index(value: int, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"ProceduralFaces: {name} must be a non-negative integer, got {value!r}.")
        return int(value)

    # ---- nuisance

    def clean_nuisance(self) -> dict:
        """Nuisance for a frontal, undegraded face in the canonical (template-like) pose."""
        return dict(_CLEAN_NUISANCE)

    def _draw_dynamic(self, rng: random.Random) -> dict:
        """Values that may change from frame to frame; every draw unconditional (stable streams)."""
        c = self.config
        r = [rng.random() for _ in range(24)]
        g = [rng.gauss(0.0, 1.0) for _ in range(4)]
        blo, bhi = c.brightness_min, c.brightness_max
        clo, chi = c.contrast_min, c.contrast_max
        dyn = {
            "yaw": (2 * r[0] - 1) * c.yaw_deg,
            "pitch": (2 * r[1] - 1) * c.pitch_deg,
            "smile": r[3] if r[2] < c.smile_prob else 0.0,
            "mouth_open": r[5] if r[4] < c.mouth_open_prob else 0.0,
            "eye_closure": 0.6 + 0.4 * r[7] if r[6] < c.blink_prob else 0.25 * r[7],
            "light_angle": 360.0 * r[8],
            "light_strength": c.light_strength * r[9],
            "brightness": blo + (bhi - blo) * r[10],
            "contrast": clo + (chi - clo) * r[11],
            "blur": 0.4 + (c.blur_sigma_max - 0.4) * r[13] if r[12] < c.blur_prob else 0.0,
            "lowres": c.lowres_min + (0.7 - c.lowres_min) * r[15] if r[14] < c.lowres_prob else 1.0,
            "noise": 2.0 + (c.noise_std_max - 2.0) * r[17] if r[16] < c.noise_prob else 0.0,
            "jpeg_quality": c.jpeg_quality_min + (90 - c.jpeg_quality_min) * r[19] if r[18] < c.jpeg_prob else 100.0,
        }
        if c.aligned:
            dyn["place_rot"] = c.aligned_rotation_deg * g[0]
            dyn["place_scale"] = math.exp(c.aligned_scale_jitter * g[1])
            dyn["place_tx"], dyn["place_ty"] = c.aligned_shift * g[2], c.aligned_shift * g[3]
        else:
            lo, hi = c.scale_min, c.scale_max
            dyn["place_rot"] = (2 * r[20] - 1) * c.rotation_deg
            dyn["place_scale"] = lo + (hi - lo) * r[21]
            dyn["place_tx"], dyn["place_ty"] = (2 * r[22] - 1) * c.shift, (2 * r[23] - 1) * c.shift
        return dyn

    def _draw_static(self, rng: random.Random) -> dict:
        """Values fixed within a sequence: colour cast, background, occluders."""
        c = self.config
        r = [rng.random() for _ in range(12)]
        cast = [rng.gauss(0.0, 1.0) * c.color_cast for _ in range(3)]
        sunglasses = r[3] < c.sunglasses_prob
        return {
            "cast_r": cast[0], "cast_g": cast[1], "cast_b": cast[2],
            "background_seed": rng.getrandbits(31),
            "clutter": min(c.clutter_max, int(r[0] * (c.clutter_max + 1))),
            "stripes": r[1] < c.stripes_prob,
            "glasses": r[2] < c.glasses_prob and not sunglasses,
            "sunglasses": sunglasses,
            "mask": r[4] < c.mask_prob,
            "bar": r[5] < c.bar_prob,
            "bar_angle": 180.0 * r[6],
            "bar_offset": 0.3 * (2 * r[7] - 1),
            "bar_width": 0.08 + 0.14 * r[8],
        }

    def _finish(self, face: _Face, dyn: dict, static: dict, noise_seed: int) -> dict:
        """Complete the nuisance: place the face (fit to the template, then jitter or random similarity)."""
        n = dict(_CLEAN_NUISANCE)
        n.update(static)
        for key in ("yaw", "pitch", "smile", "mouth_open", "eye_closure", "light_angle", "light_strength",
                    "brightness", "contrast", "blur", "lowres", "noise"):
            n[key] = float(dyn[key])
        n["jpeg_quality"] = int(round(dyn["jpeg_quality"]))
        n["noise_seed"] = int(noise_seed)
        # Warped landmarks (depth warp only) fitted onto the template: what a 5-point aligner would do.
        s1, th1, t1x, t1y = _fit_similarity(_warp_points(_canonical_landmarks(face, n), n), _TEMPLATE)
        # Compose S2 ∘ S1 with S2 = place_scale · R(place_rot) about the image centre, plus a shift.
        s2, th2 = dyn["place_scale"], math.radians(dyn["place_rot"])
        c2, sn2 = math.cos(th2), math.sin(th2)
        ux, uy = t1x - 56.0, t1y - 56.0
        tx = s2 * (c2 * ux - sn2 * uy) + 56.0 + dyn["place_tx"] * 112.0
        ty = s2 * (sn2 * ux + c2 * uy) + 56.0 + dyn["place_ty"] * 112.0
        s, th = s1 * s2, th1 + th2
        # out = s R q + t  ⇔  out = s R (q − C) + C + T  with T = t − C + s R C.
        cs, sn = math.cos(th), math.sin(th)
        n["rotation"] = math.degrees(th)
        n["scale"] = s
        n["tx"] = (tx - _CX + s * (cs * _CX - sn * _CY)) / 112.0
        n["ty"] = (ty - _CY + s * (sn * _CX + cs * _CY)) / 112.0
        return n

    def _sample_nuisance(self, face: _Face, identity: int, index: int) -> dict:
        rng = _rng(self.seed, _STREAM_SAMPLE, identity, index)
        dyn = self._draw_dynamic(rng)
        static = self._draw_static(rng)
        return self._finish(face, dyn, static, rng.getrandbits(31))

    def _check_nuisance(self, nuisance: dict) -> dict:
        if not isinstance(nuisance, dict):
            raise TypeError(f"render: nuisance must be a dict, got {type(nuisance).__name__}.")
        unknown = sorted(set(nuisance) - set(_CLEAN_NUISANCE))
        missing = sorted(set(_CLEAN_NUISANCE) - set(nuisance))
        if unknown or missing:
            raise ValueError(
                f"render: nuisance has unknown keys {unknown} and lacks keys {missing}; "
                "start from clean_nuisance() and override, e.g. {**gen.clean_nuisance(), 'yaw': 20.0}."
            )
        n = {}
        for key, value in nuisance.items():
            if key in _BOOL_NUISANCE:
                n[key] = bool(value)
            elif key in _INT_NUISANCE:
                n[key] = int(value)
            else:
                n[key] = float(value)
        if n["scale"] <= 0 or not 1 <= n["jpeg_quality"] <= 100 or not 0 < n["lowres"] <= 1:
            raise ValueError(
                f"render: nuisance out of range: scale={n['scale']} (> 0), jpeg_quality={n['jpeg_quality']} "
                f"(1..100), lowres={n['lowres']} (0, 1]."
            )
        if abs(n["yaw"]) >= 80 or abs(n["pitch"]) >= 80:
            raise ValueError(f"render: |yaw|, |pitch| must be < 80 degrees, got {n['yaw']}, {n['pitch']}.")
        return n

    # ---- public sampling

    def sample(self, identity: int, index: int) -> FaceSample:
        """Image ``index`` of ``identity``; deterministic in (seed, identity, index)."""
        face = self._face(identity)
        index = self._check_index(index, "index")
        return self._render(face, self._sample_nuisance(face, int(identity), index))

    def sample_nuisance(self, identity: int, index: int) -> dict:
        """The nuisance :meth:`sample` renders image ``index`` of ``identity`` with (nothing is rendered)."""
        face = self._face(identity)
        return self._sample_nuisance(face, int(identity), self._check_index(index, "index"))

    def sequence(self, identity: int, length: int, seq_index: int = 0) -> list[FaceSample]:
        """A video-like sequence: pose, expression and degradations follow a smooth random walk.

        Knots every 8 frames follow a random walk (each halfway from the previous knot to a fresh draw
        from the per-image distributions) joined by cosine interpolation, so consecutive frames differ
        a little and distant ones more; background, colour cast and occluders stay fixed.
        """
        face = self._face(identity)
        return [self._render(face, n) for n in self.sequence_nuisance(identity, length, seq_index)]

    def sequence_nuisance(self, identity: int, length: int, seq_index: int = 0) -> list[dict]:
        """The per-frame nuisance of :meth:`sequence` (nothing is rendered)."""
        return list(self.iter_sequence_nuisance(identity, length, seq_index))

    def iter_sequence_nuisance(self, identity: int, length: int, seq_index: int = 0) -> Iterator[dict]:
        """:meth:`sequence_nuisance` one frame at a time, holding only the walk's knots (one per 8 frames) and one
        noise seed per frame: for probes of tens of thousands of frames. Arguments are checked at the call."""
        face = self._face(identity)
        seq_index = self._check_index(seq_index, "seq_index")
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"sequence: length must be a positive integer, got {length!r}.")
        rng = _rng(self.seed, _STREAM_SEQUENCE, int(identity), seq_index)
        static = self._draw_static(rng)
        stride = 8
        knots = [self._draw_dynamic(rng)]
        for _ in range((length - 1) // stride + 1):  # a random walk: each knot halfway to a fresh draw
            fresh = self._draw_dynamic(rng)
            knots.append({key: 0.5 * (knots[-1][key] + fresh[key]) for key in _SMOOTH_KEYS})
        noise_seeds = [rng.getrandbits(31) for _ in range(length)]

        def frames() -> Iterator[dict]:
            for t in range(length):
                j, frac = divmod(t, stride)
                w = 0.5 - 0.5 * math.cos(math.pi * frac / stride)
                dyn = {key: (1 - w) * knots[j][key] + w * knots[j + 1][key] for key in _SMOOTH_KEYS}
                yield self._finish(face, dyn, static, noise_seeds[t])

        return frames()

    def render(self, identity: int, nuisance: dict) -> FaceSample:
        """Render ``identity`` with explicit nuisance values (all keys of :meth:`clean_nuisance`)."""
        return self._render(self._face(identity), self._check_nuisance(nuisance))

    # ---- rendering

    def _render(self, face: _Face, n: dict) -> FaceSample:
        size = self.config.image_size
        view = _View(size, n)
        bg = random.Random(2 * n["background_seed"])
        img = np.empty((3, size, size), dtype=np.float32)
        _draw_background(img, view, n, bg)
        _draw_head(img, view, face, n, bg)
        _draw_occluders(img, view, face, n)
        out = _degrade(img, view, n)
        landmarks = np.array(view.points(_canonical_landmarks(face, n)), dtype=np.float32)
        return FaceSample(image=out, landmarks=landmarks, quality=quality_score(n), nuisance=n)
