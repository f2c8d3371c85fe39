"""MLflow pyfunc wrapper so a registered ``faceops-*`` embedding model (FR, discovery) loads with
``mlflow.pyfunc.load_model`` and serves with ``mlflow models serve``.

The serving contract, logged as the model's signature with an input example: input uint8 RGB images
``(N, S, S, 3)`` (values 0–255, channels last, S = the model's ``input_contract.size``); output float32 ``(N, D)``
L2-normalised embeddings (D = ``input_contract.embedding_dim``). The model converts the images to the backbone's
own tensor (``input_contract.layout``, NCHW float32 after ``scale`` and ``mean``/``std``) itself. Over HTTP the
images go as a nested list: ``{"inputs": [[[[r, g, b], ...], ...], ...]}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import Schema, TensorSpec

from ml.errors import DataError


def model_contract(model_dir: Path) -> tuple[int, int]:
    """(input size S, embedding dim D) of a faceops embedding model directory, from its ``config.json``."""
    contract = json.loads((Path(model_dir) / "config.json").read_text()).get("input_contract") or {}
    if not isinstance(contract.get("size"), int) or not isinstance(contract.get("embedding_dim"), int):
        raise DataError(f"{model_dir}/config.json has no input_contract with an integer size and embedding_dim; "
                         "re-save the model with the faceops save function of its kind")
    return contract["size"], contract["embedding_dim"]


def signature(model_dir: Path) -> ModelSignature:
    """uint8 (-1, S, S, 3) RGB images → float32 (-1, D) L2-normalised embeddings."""
    size, dim = model_contract(model_dir)
    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.uint8), (-1, size, size, 3))]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, dim))]))


def input_example(model_dir: Path) -> np.ndarray:
    """One aligned face of the model's input size, uint8 (1, S, S, 3): a procedural face (no real person's), so
    the example a user copies from the MLflow UI returns a face's embedding, not a grey square's."""
    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    size, _ = model_contract(model_dir)
    faces = ProceduralFaces(ProceduralConfig(image_size=size), seed=0)
    return faces.render(0, faces.sample_nuisance(0, 0)).image[None].astype(np.uint8)


def check_images(model_input: Any, size: int) -> np.ndarray:
    """``model_input`` as uint8 (N, size, size, 3); else an ``MlflowException`` (HTTP 400 when served) saying what
    was expected and what came. Integer arrays with values in 0–255 are accepted as they are; floats are not
    (a float image in 0–1 would silently turn black)."""
    expected = (f"expected uint8 RGB images of shape (N, {size}, {size}, 3), values 0-255, channels last "
                '(JSON: {"inputs": [[[[r, g, b], ...], ...], ...]})')
    try:
        images = np.asarray(model_input)
    except ValueError as exc:  # ragged nested lists
        raise MlflowException(f"{expected}; got a ragged nested list ({exc})", INVALID_PARAMETER_VALUE) from exc
    got = f"got {images.dtype} of shape {images.shape}"
    if images.ndim != 4 or images.shape[1:] != (size, size, 3):
        raise MlflowException(f"{expected}; {got}", INVALID_PARAMETER_VALUE)
    if images.dtype != np.uint8:
        if images.dtype.kind not in "iu":
            raise MlflowException(f"{expected}; {got}", INVALID_PARAMETER_VALUE)
        if images.size and (images.min() < 0 or images.max() > 255):
            raise MlflowException(f"{expected}; {got} with values {images.min()}..{images.max()}",
                                  INVALID_PARAMETER_VALUE)
        images = images.astype(np.uint8)
    return images


class FaceEmbedder(mlflow.pyfunc.PythonModel):
    """Input: uint8 images (N, S, S, 3) RGB of the model's input size. Output: float32 (N, D) embeddings
    (FR: with flip test-time augmentation), L2-normalised."""

    def load_context(self, context: Any) -> None:
        model_dir = Path(context.artifacts["model_dir"])
        self.architecture = json.loads((model_dir / "config.json").read_text()).get("architecture", "backbone")
        if self.architecture == "facegcd":
            from ml.discovery.facegcd import load_facegcd

            self.model, self.config = load_facegcd(model_dir)
        else:
            from ml.models.io import load_model

            self.model, self.config = load_model(model_dir)
        self.size, _ = model_contract(model_dir)

    # no type hints: MLflow reads the hint of ``model_input`` as a schema and warns at every load that ``Any`` is
    # not one (the signature logged with the model is the schema)
    def predict(self, context, model_input, params=None):
        images = check_images(model_input, self.size)
        if self.architecture == "facegcd":  # the discovery model's clustering features (no flip TTA in FaceGCD)
            return self.model.embed(images)
        from ml.fr.train import embed

        feats = embed(self.model, images, flip=True)
        return feats / np.linalg.norm(feats, axis=1, keepdims=True).clip(1e-12)
