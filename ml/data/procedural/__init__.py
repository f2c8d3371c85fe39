"""Procedural faces: the embedded default dataset, with exact 5-point landmarks.

An identity is a fixed random vector of facial geometry and appearance drawn from ``(seed, identity)``; a sample
draws it under per-image nuisance from ``(seed, identity, index)``: pose, expression, illumination, background
clutter, occluders and degradations, as often and as strongly as :class:`ProceduralConfig` says. Features live in
a canonical frame in ArcFace-112 units, each at a depth ``z``; a canonical point ``p`` is drawn at

    q = C + diag(cos ψ, cos φ)(p − C) + z·(sin ψ, sin φ),   out = s·R(θ)(q − C) + C + t,   pixel = out·size/112

(yaw ψ, pitch φ, C = (56, 72), t = 112·(tx, ty)). The 5 landmarks go through the same maps: exact for every pose
and expression. ``aligned`` mode takes the similarity from the Umeyama fit of the warped landmarks onto the
ArcFace template (plus jitter); unaligned mode composes a large random similarity on top. ``quality`` is a product
of per-degradation factors in [0, 1] (:func:`quality_score`); :func:`render_nonface` draws face-free crops. Every
draw is made whether or not its nuisance fires, so changing one probability never reshuffles the others.
Modules: ``config``, ``identity``, ``geometry``, ``draw``, ``occluders``, ``degrade``, ``generator``, ``nonface``.
"""

from ml.data.procedural.config import (
    ARCFACE_TEMPLATE_112,
    NUISANCE_KEYS,
    FaceSample,
    ProceduralConfig,
    arcface_template,
    quality_score,
)
from ml.data.procedural.generator import ProceduralFaces
from ml.data.procedural.nonface import NONFACE_KINDS, nonface_kind, render_nonface, render_nonfaces

__all__ = [
    "ARCFACE_TEMPLATE_112",
    "FaceSample",
    "NONFACE_KINDS",
    "NUISANCE_KEYS",
    "ProceduralConfig",
    "ProceduralFaces",
    "arcface_template",
    "nonface_kind",
    "quality_score",
    "render_nonface",
    "render_nonfaces",
]
