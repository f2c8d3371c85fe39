"""Non-face crops from the face renderer, negatives for a face/no-face score (the DFA aligner's score head):
background clutter alone, a face pushed out of the frame, or a face under an opaque cover."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import numpy as np

from ml.data.procedural.config import _STREAM_NONFACE, ProceduralConfig, _rng
from ml.data.procedural.degrade import _degrade
from ml.data.procedural.draw import _draw_background, _draw_head
from ml.data.procedural.generator import ProceduralFaces
from ml.data.procedural.geometry import _View
from ml.data.procedural.identity import _canonical_landmarks
from ml.data.procedural.occluders import _draw_cover, _draw_occluders
from ml.errors import ConfigError

NONFACE_KINDS: tuple[str, ...] = ("clutter", "off_frame", "covered")
_NONFACE_CUMULATIVE = (0.5, 0.8, 1.0)  # kind shares 50 / 30 / 20 %
_NONFACE_IDENTITY0 = 1 << 40  # partial faces use identities far above any dataset's range
_OFF_FRAME_MARGIN = 0.03  # every landmark at least this fraction of the side outside the crop


@functools.lru_cache(maxsize=8)
def _nonface_generator(config: ProceduralConfig, seed: int) -> ProceduralFaces:
    return ProceduralFaces(config, seed=seed)


def _nonface_args(seed: int, index: int, size: int, config: ProceduralConfig | None) -> ProceduralConfig:
    for name, value in (("seed", seed), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"render_nonface: {name} must be a non-negative integer, got {value!r}.")
    base = ProceduralConfig(aligned=False) if config is None else config
    if not isinstance(base, ProceduralConfig):
        raise ConfigError(f"render_nonface: config must be a ProceduralConfig, got {type(base).__name__}.")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ConfigError(f"render_nonface: size must be an integer number of pixels, got {size!r}.")
    return dataclasses.replace(base, image_size=int(size))  # ProceduralConfig checks 32 ≤ size ≤ 1024


def nonface_kind(seed: int, index: int) -> str:
    """Which of :data:`NONFACE_KINDS` ``render_nonface(seed, index, …)`` draws (the first draw of its stream)."""
    u = _rng(int(seed), _STREAM_NONFACE, int(index)).random()
    return NONFACE_KINDS[next(i for i, c in enumerate(_NONFACE_CUMULATIVE) if u < c)]


def render_nonface(seed: int, index: int, size: int = 96, config: ProceduralConfig | None = None) -> np.ndarray:
    """A crop without a usable face, (size, size, 3) uint8 RGB; deterministic in (seed, index, size, config).

    Three kinds (:func:`nonface_kind`), drawn from the stream ``(seed, 5, index)``:

    - ``clutter`` (50 %): the face renderer's background alone (gradient, stripes, 1 … 2·clutter_max + 2
      random boxes, bars, ellipses and rings);
    - ``off_frame`` (30 %): a face whose placement is pushed in a random direction until all 5 landmarks
      lie at least 3 % of the side outside the crop (hair, an ear or a cheek may remain at the border);
    - ``covered`` (20 %): a face in an ordinary pose with one opaque box or ellipse over its eyes, nose and
      mouth (the landmarks' bounding box grown by 1.3–1.6×, plus 5 % of the side).

    Pose, lighting, colour cast, clutter and degradations (blur, noise, JPEG, low resolution) are drawn as
    for a face sample of ``config`` (default ``ProceduralConfig(aligned=False)``, its ``image_size`` replaced
    by ``size``), so they cannot tell faces from non-faces. Partial faces use identities ``2⁴⁰ + index``,
    disjoint from any dataset's. Cost: about one face render.
    """
    cfg = _nonface_args(seed, index, size, config)
    gen = _nonface_generator(cfg, int(seed))
    rng = _rng(int(seed), _STREAM_NONFACE, int(index))
    u = rng.random()  # the kind; the same first draw as nonface_kind
    kind = next(i for i, c in enumerate(_NONFACE_CUMULATIVE) if u < c)
    identity = _NONFACE_IDENTITY0 + int(index)
    face = gen._face(identity)
    n = gen._sample_nuisance(face, identity, 0)  # pose, light, background, occluders, degradations
    size = cfg.image_size
    if kind == 1:  # off_frame: push the placement until no landmark is inside the crop
        ang, dist = rng.uniform(0.0, 2.0 * math.pi), rng.uniform(0.6, 0.85)
        base_tx, base_ty = n["tx"], n["ty"]
        lo, hi = -0.5 - _OFF_FRAME_MARGIN * size, size - 0.5 + _OFF_FRAME_MARGIN * size
        while True:
            n["tx"], n["ty"] = base_tx + dist * math.cos(ang), base_ty + dist * math.sin(ang)
            pts = _View(size, n).points(_canonical_landmarks(face, n))
            if all(x < lo or x > hi or y < lo or y > hi for x, y in pts):
                break
            dist += 0.05
    view = _View(size, n)
    img = np.empty((3, size, size), dtype=np.float32)
    bg = random.Random(2 * n["background_seed"])
    if kind == 0:  # clutter only
        n["clutter"] = rng.randint(1, 2 * cfg.clutter_max + 2)
    _draw_background(img, view, n, bg)
    if kind != 0:
        _draw_head(img, view, face, n, bg)
        _draw_occluders(img, view, face, n)
    if kind == 2:
        _draw_cover(img, view, view.points(_canonical_landmarks(face, n)), rng)
    return _degrade(img, view, n)


def render_nonfaces(seed: int, indices, size: int = 96, config: ProceduralConfig | None = None) -> np.ndarray:
    """:func:`render_nonface` for each of ``indices`` (an iterable of non-negative ints), stacked:
    uint8 (N, size, size, 3)."""
    indices = [int(i) for i in indices]
    cfg = _nonface_args(seed, 0, size, config)
    out = np.empty((len(indices), cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
    for row, index in enumerate(indices):
        out[row] = render_nonface(seed, index, size, config)
    return out
