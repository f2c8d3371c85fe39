"""MLflow pyfunc wrapper so a registered ``faceops-*`` FR model loads with ``mlflow.pyfunc.load_model``."""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import numpy as np


class FaceEmbedder(mlflow.pyfunc.PythonModel):
    """Input: uint8 images (N, H, W, 3) RGB of the model's input size. Output: float32 (N, D) embeddings
    with flip test-time augmentation, L2-normalised."""

    def load_context(self, context: Any) -> None:
        from ml.models.io import load_model

        self.model, self.config = load_model(context.artifacts["model_dir"])

    def predict(self, context: Any, model_input: Any, params: dict | None = None) -> np.ndarray:
        from ml.train.fr import embed

        images = np.asarray(model_input, dtype=np.uint8)
        feats = embed(self.model, images, flip=True)
        return feats / np.linalg.norm(feats, axis=1, keepdims=True).clip(1e-12)
