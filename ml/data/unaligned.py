"""Unaligned procedural faces with exact 5-point landmarks: training and test data for the DFA aligner.

``ProceduralConfig(aligned=False)`` renders unaligned crops natively: the face is fitted to the ArcFace template,
a random similarity about the image centre is composed on top (rotation in ``±rotation_deg``, scale in
``[scale_min, scale_max]``, shift in ``±shift`` of the side per axis) and the whole canvas is rendered in that
pose, so the landmarks are exact: no resampling of an aligned crop, no empty borders, no interpolation blur. This
module picks those knobs, keeps for identity ``i`` the first ``per_identity`` of its sample indices 0, 1, 2, … whose
landmarks lie ``margin`` inside the image (deterministic), and stacks the result.

Face box (``return_face_size``; the normaliser of ``ml.aligner.metrics.nme_box``): the renderer's outline spans
``2·face_w × 2·face_h`` canonical units, so along the face's own axes ``W = 2·face_w·cos(yaw)·s·size/112`` and
``H = 2·face_h·cos(pitch)·s·size/112`` pixels, ``√(W·H) = 2·√(face_w·face_h)·ppu`` (jaw taper and ears excluded).

Differences from the reference: KP-RPE trains DFA on WiderFace faces cropped by their ground-truth boxes (padding
0.1) and resized to 160; here the faces, their pose statistics (defaults ±30°, scale 0.7–1.2 of the template
placement, shift ±0.15 of the side), yaw/pitch and degradations are procedural.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
from tqdm.auto import tqdm

from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.errors import ConfigError, DataError

__all__ = ["renderer_face_size", "unaligned_config", "unaligned_faces"]

log = logging.getLogger(__name__)


def unaligned_config(
    size: int = 128,
    *,
    rotation_deg: float = 30.0,
    scale: tuple[float, float] = (0.7, 1.2),
    shift: float = 0.15,
    base: ProceduralConfig | None = None,
) -> ProceduralConfig:
    """``base`` (default ``ProceduralConfig()``) rendering ``size``² unaligned crops with these pose ranges."""
    base = base if base is not None else ProceduralConfig()
    if not isinstance(base, ProceduralConfig):
        raise ConfigError(f"unaligned_faces: base must be a ProceduralConfig, got {type(base).__name__}")
    if len(tuple(scale)) != 2:
        raise ConfigError(f"unaligned_faces: scale must be (min, max), got {scale!r}")
    return dataclasses.replace(
        base, image_size=int(size), aligned=False, rotation_deg=float(rotation_deg),
        scale_min=float(scale[0]), scale_max=float(scale[1]), shift=float(shift),
    )


def renderer_face_size(identity: dict[str, float], nuisance: dict, size: int) -> float:
    """``√(W·H)`` in pixels of the renderer's face box (module docstring) for a face of ``identity``
    (``ProceduralFaces.identity``) rendered at ``size``² with ``nuisance`` (``FaceSample.nuisance``)."""
    ppu = nuisance["scale"] * size / 112.0 * math.sqrt(math.cos(math.radians(nuisance["yaw"]))
                                                        * math.cos(math.radians(nuisance["pitch"])))
    return 2.0 * math.sqrt(identity["face_w"] * identity["face_h"]) * ppu


def unaligned_faces(
    n_identities: int,
    per_identity: int,
    size: int = 128,
    seed: int = 0,
    *,
    rotation_deg: float = 30.0,
    scale: tuple[float, float] = (0.7, 1.2),
    shift: float = 0.15,
    margin: float = 0.02,
    first_identity: int = 0,
    base: ProceduralConfig | None = None,
    progress: bool = False,
    return_quality: bool = False,
    return_face_size: bool = False,
) -> tuple[np.ndarray, ...]:
    """Render ``n_identities × per_identity`` unaligned faces.

    Returns ``images`` uint8 (N, size, size, 3) RGB, ``landmarks`` float32 (N, 5, 2) pixel x, y (pixel
    centres at integers, ArcFace order) and ``identities`` int64 (N,) = ``first_identity + i``, and with
    ``return_quality`` also each face's procedural ``quality`` float32 (N,) (:func:`ml.data.procedural.quality_score`),
    then with ``return_face_size`` the side ``√(W·H)`` float32 (N,) of each face's box in pixels
    (:func:`renderer_face_size`).
    Use a different ``first_identity`` range (or seed) for held-out faces.
    """
    for name, value, low in (("n_identities", n_identities, 1), ("per_identity", per_identity, 1),
                             ("first_identity", first_identity, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ConfigError(f"unaligned_faces: {name} must be an integer ≥ {low}, got {value!r}")
    if not 0.0 <= margin < 0.5:
        raise ConfigError(f"unaligned_faces: margin must lie in [0, 0.5) of the side, got {margin!r}")
    cfg = unaligned_config(size, rotation_deg=rotation_deg, scale=scale, shift=shift, base=base)
    gen = ProceduralFaces(cfg, seed=seed)
    lo, hi = margin * size - 0.5, (1.0 - margin) * size - 0.5  # allowed landmark range, pixel centres at integers
    max_tries = 20 * per_identity + 20
    n = n_identities * per_identity
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    landmarks = np.empty((n, 5, 2), dtype=np.float32)
    quality = np.empty(n, dtype=np.float32)
    face_size = np.empty(n, dtype=np.float32)
    identities = np.repeat(np.arange(first_identity, first_identity + n_identities, dtype=np.int64), per_identity)
    row = rejected = 0
    with tqdm(total=n, unit="face", desc="unaligned faces", disable=not progress) as bar:
        for identity in range(first_identity, first_identity + n_identities):
            kept = index = 0
            while kept < per_identity:
                if index >= max_tries:
                    raise DataError(
                        f"unaligned_faces: identity {identity} kept only {kept} of {per_identity} faces in {max_tries} "
                        f"draws with landmarks inside the image (margin {margin}); lower scale[1]={scale[1]} or "
                        f"shift={shift}, or the margin"
                    )
                sample = gen.sample(identity, index)
                index += 1
                if sample.landmarks.min() < lo or sample.landmarks.max() > hi:
                    rejected += 1
                    continue
                images[row], landmarks[row], quality[row] = sample.image, sample.landmarks, sample.quality
                if return_face_size:
                    face_size[row] = renderer_face_size(gen.identity(identity), sample.nuisance, size)
                row += 1
                kept += 1
                bar.update(1)
    log.info("rendered %d unaligned %d-px faces (%d draws rejected: landmarks outside the image)", n, size, rejected)
    out = (images, landmarks, identities) + ((quality,) if return_quality else ())
    return out + ((face_size,) if return_face_size else ())
