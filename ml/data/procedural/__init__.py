"""Procedural faces: the embedded default dataset, with exact 5-point landmarks.

An *identity* is a fixed random vector of facial geometry and appearance (face outline and jaw, skin
tone, eyes, iris colour, brows, nose, mouth, ears, hair colour/line/style, beard, moles and freckles),
sampled from ``(seed, identity)``. A *sample* draws that identity under per-image nuisance sampled from
``(seed, identity, index)``: pose (in-plane rotation, yaw, pitch, scale, translation), expression,
illumination and colour cast, background clutter, occluders (glasses, sunglasses, mask, bar) and
degradations (blur, low resolution, noise, JPEG). :class:`ProceduralConfig` sets how often and how
strongly each nuisance occurs.

Frames and the exact landmarks
------------------------------
Shapes are defined in a *canonical frame* measured in ArcFace-112 units: an average frontal face put
there has its 5 landmarks on the ArcFace template. Each feature has a depth ``z`` (nose 22, mouth 9,
eyes and brows 8, face outline 0, hair behind −6, ears −18). Rendering a canonical point ``p`` at depth
``z`` takes two maps:

- depth warp (yaw ψ, pitch φ):  ``q = C + diag(cos ψ, cos φ) (p − C) + z (sin ψ, sin φ)``, so the nose
  shifts sideways more than the eyes and the outline compresses;
- similarity:                   ``out = s R(θ) (q − C) + C + t``, then ``pixel = out · size / 112``,

with ``C = (56, 72)``, ``t = 112·(tx, ty)`` and pixel centres at integer coordinates. Both maps are
affine for a fixed depth, so every feature is drawn by inverse-mapping its pixel box into its own
canonical frame and evaluating soft-edged implicit shapes there (1-px linear edges for antialiasing),
alpha-composited back to front.
The 5 landmarks are the canonical eye centres, nose tip and mouth corners pushed through the very same
two maps, so they are exact for every pose and expression.

In ``aligned`` mode the similarity is the least-squares fit (Umeyama) of the warped landmarks onto the
ArcFace template, as a 5-point aligner would produce, plus a small jitter; the identity's own geometry
still moves the landmarks off the template. In unaligned mode a large random similarity about the image
centre is composed on top of that fit.

Quality is a product of per-degradation factors in ``[0, 1]`` (blur, noise, JPEG, low resolution,
occlusion, pose, darkness), so more of any degradation never raises it; see :func:`quality_score`.

:func:`render_nonface` draws crops without a usable face from the same renderer (background clutter alone,
a face pushed out of the frame, a face under an opaque cover), negatives for a face/no-face score.

Determinism and speed
---------------------
Identities draw from ``numpy.random.default_rng([seed, 1, identity])``; per-image nuisance draws from
Python's ``random.Random`` seeded with strings such as ``"seed:2:identity:index"`` (hashed with SHA-512,
the same on every platform, and far cheaper per scalar draw than numpy). Every draw is made whether or
not its nuisance fires, so changing one probability does not reshuffle the others. A 112×112 face costs
a few hundred small numpy calls, so the renderer minimises calls rather than arithmetic: features are
evaluated only in their pixel box, mirrored pairs (eyes, brows, ears, nostrils) in one pass, on a
contiguous copy of the box; Gaussian blur is separable shifted adds (no BLAS, whose threads misbehave
in busy data loaders) and sensor noise is a seeded window of a fixed noise bank.

Modules
-------
``config`` (:class:`ProceduralConfig`, :class:`FaceSample`, the nuisance keys, :func:`quality_score`, the
template), ``identity`` (identity parameters), ``geometry`` (the two maps and canvas primitives), ``draw`` and
``occluders`` (the layers), ``degrade`` (illumination, blur, low resolution, noise, JPEG), ``generator``
(:class:`ProceduralFaces`) and ``nonface`` (:func:`render_nonface`); this package exports their public names.
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
