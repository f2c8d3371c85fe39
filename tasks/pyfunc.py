"""MLflow pyfunc wrapper so a registered ``faceops-*`` embedding model (FR, discovery) loads with
``mlflow.pyfunc.load_model``."""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import numpy as np


class FaceEmbedder(mlflow.pyfunc.PythonModel):
    """Input: uint8 images (N, H, W, 3) RGB of the model's input size. Output: float32 (N, D) embeddings
    with flip test-time augmentation, L2-normalised."""

    def load_context(self, context: Any) -> None:
        import json
        from pathlib import Path

        model_dir = Path(context.artifacts["model_dir"])
        self.architecture = json.loads((model_dir / "config.json").read_text()).get("architecture", "backbone")
        if self.architecture == "facegcd":
            from ml.models.discovery.facegcd import load_facegcd

            self.model, self.config = load_facegcd(model_dir)
        else:
            from ml.models.io import load_model

            self.model, self.config = load_model(model_dir)

    def predict(self, context: Any, model_input: Any, params: dict | None = None) -> np.ndarray:
        images = np.asarray(model_input, dtype=np.uint8)
        if self.architecture == "facegcd":  # the discovery model's clustering features (no flip TTA in FaceGCD)
            return self.model.embed(images)
        from ml.train.fr import embed

        feats = embed(self.model, images, flip=True)
        return feats / np.linalg.norm(feats, axis=1, keepdims=True).clip(1e-12)
