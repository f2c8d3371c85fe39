"""ONNX export of the face backbones, with the input contract stored in the file.

Graph interface (every registered backbone, eval mode)::

    images     (B, 3, S, S) float32, normalised as the contract says ((x/255 − 0.5)/0.5 for ours)
    keypoints  (B, 5, 2)    float32 pixel (x, y) in the S×S input, ArcFace order — KP-RPE models only
    embeddings (B, D)       float32, unnormalised (L2-normalise before cosine matching)

``B`` is the symbolic dimension ``batch`` with ``dynamic_batch`` (the default), else the export batch size. The
``input_contract`` is stored as JSON under :data:`META_CONTRACT`; :func:`read_metadata` decodes every ``faceops.*``
key. Exporter: the TorchScript tracer (``torch.onnx.export(..., dynamo=False)``), which writes the requested opset
(14 to 20) directly; the written file is checked to carry it. The ``dynamo=True`` exporter builds every graph at
opset 18 and converts down, and fails on KP-RPE: it records the ``reshape`` after ``scaled_dot_product_attention``
(with the float KP-RPE mask) as a ``view`` that the attention output's strides do not allow.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from ml.data.procedural import arcface_template
from ml.errors import ConfigError, DataError
from ml.fr.backbones import input_contract
from ml.models.io import CONFIG, WEIGHTS, load_model

log = logging.getLogger(__name__)

IMAGES = "images"
KEYPOINTS = "keypoints"
EMBEDDINGS = "embeddings"
BATCH_DIM = "batch"
META_CONTRACT = "faceops.input_contract"  # JSON: the backbone's input_contract
META_BACKBONE = "faceops.backbone"  # registry name, from a model directory's config.json
META_KWARGS = "faceops.kwargs"  # JSON: constructor overrides, from config.json
META_PREFIX = "faceops."
# scaled_dot_product_attention has no ONNX form below 14; the TorchScript exporter supports up to 20
# (above that it only warns).
MIN_OPSET, MAX_OPSET = 14, 20
KEYPOINT_JITTER = 0.04  # std of the random landmarks around the template, as a share of S (≈4.5 px at 112)


def needs_keypoints(model: nn.Module) -> bool:
    """Whether ``model`` is called as ``model(images, keypoints)`` (KP-RPE backbones)."""
    return bool(getattr(model, "needs_keypoints", False))


def _check_model(model: Any) -> dict[str, Any]:
    """The input contract of ``model``, after checking it is a float32 backbone."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"export needs a torch nn.Module backbone, got {type(model).__name__}")
    contract = input_contract(model)  # raises ConfigError when the class declares none
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if dtypes:
        raise ConfigError(
            f"{type(model).__name__} has {', '.join(dtypes)} parameters; the ONNX contract is float32, "
            "so export model.float() instead"
        )
    return contract


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def random_inputs(model: nn.Module, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random ``(images,)`` or ``(images, keypoints)`` for ``model``, on its device.

    Images are N(0, 1) (the range of normalised pixels); keypoints are the ArcFace template for the
    model's size plus N(0, (0.04·S)²) per coordinate, so each row is a plausible, distinct face layout.
    """
    size = int(input_contract(model)["size"])
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, size, size, generator=gen)
    inputs = [images]
    if needs_keypoints(model):
        template = torch.from_numpy(arcface_template(size))  # (5, 2) pixel x, y
        jitter = torch.randn(batch, *template.shape, generator=gen) * (KEYPOINT_JITTER * size)
        inputs.append(template + jitter)  # (B, 5, 2)
    device = next(model.parameters()).device
    return tuple(t.to(device) for t in inputs)


def _export_proto(
    model: nn.Module, args: tuple[torch.Tensor, ...], names: list[str], opset: int, dynamic_batch: bool
) -> onnx.ModelProto:
    """Trace ``model`` on ``args`` into an in-memory ONNX model with the given input names."""
    dynamic_axes = {n: {0: BATCH_DIM} for n in [*names, EMBEDDINGS]} if dynamic_batch else None
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of dynamo=True, which cannot export KP-RPE
        # (see the module docstring). Its TracerWarnings come from the backbones' input checks, which
        # compare shapes the contract fixes (channels, S, 5 landmarks), so they hold for every input;
        # onnx_parity is the check that the graph generalises.
        warnings.filterwarnings(
            "ignore", message="You are using the legacy TorchScript", category=DeprecationWarning
        )
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            model,
            args,
            buffer,
            dynamo=False,
            input_names=names,
            output_names=[EMBEDDINGS],
            opset_version=opset,
            dynamic_axes=dynamic_axes,
        )
    return onnx.load_model_from_string(buffer.getvalue())


def _set_metadata(proto: onnx.ModelProto, metadata: dict[str, str]) -> None:
    """Add or replace ``metadata_props`` entries of ``proto``."""
    kept = [p for p in proto.metadata_props if p.key not in metadata]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)


def _opset(proto: onnx.ModelProto) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def _write_atomic(proto: onnx.ModelProto, path: Path) -> None:
    """Save ``proto`` to a temporary sibling of ``path``, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        onnx.save_model(proto, str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    opset: int = 17,
    batch_size: int = 2,
    dynamic_batch: bool = True,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Export ``model`` in eval mode to the ONNX file ``path`` (written atomically); return the path.

    Inputs ``images`` (and ``keypoints`` for KP-RPE), output ``embeddings``; see the module docstring.
    The model is traced on a random batch of ``batch_size`` (:func:`random_inputs`); with
    ``dynamic_batch`` the file takes any batch size, else exactly ``batch_size``.
    ``metadata`` adds string entries to the file's ``metadata_props`` beside the input contract.
    The model's train/eval mode is restored afterwards.
    """
    contract = _check_model(model)
    path = Path(path)
    _positive_int(batch_size, "export batch_size")
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ConfigError(
            f"ONNX opset must be an integer from {MIN_OPSET} (the attention needs it) to {MAX_OPSET} (the "
            f"newest the TorchScript exporter writes), got {opset!r}"
        )
    if path.is_dir():
        raise ConfigError(f"ONNX output path {path} is a directory; give a file name such as {path / 'model.onnx'}")
    meta = {META_CONTRACT: json.dumps(contract, sort_keys=True), **(metadata or {})}
    bad_meta = sorted(k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad_meta:
        raise ConfigError(f"ONNX metadata keys and values must be strings; not so for {bad_meta}")

    args = random_inputs(model, batch_size)
    names = [IMAGES, KEYPOINTS][: len(args)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            proto = _export_proto(model, args, names, opset, dynamic_batch)
    finally:
        model.train(was_training)
    got = _opset(proto)
    if got != opset:
        raise ConfigError(
            f"the exporter wrote {type(model).__name__} at ONNX opset {got} instead of the requested {opset}; "
            f"pass opset={got} if your runtime supports it"
        )
    _set_metadata(proto, meta)
    onnx.checker.check_model(proto, full_check=True)
    _write_atomic(proto, path)
    log.info("exported %s (inputs %s, opset %d, batch %s) to %s", type(model).__name__, names, opset,
             BATCH_DIM if dynamic_batch else batch_size, path)
    return path


def export_model_dir(
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    opset: int = 17,
    batch_size: int = 2,
    dynamic_batch: bool = True,
) -> Path:
    """Export the model saved in ``model_dir`` (``ml.models.io.save_model``) to ``path``.

    Besides the input contract, the metadata holds the backbone name and its constructor overrides,
    so the file names the network it was made from.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DataError(
            f"model directory {model_dir} does not exist or is not a directory; pass a directory written "
            f"by save_model (with {CONFIG} and {WEIGHTS}), e.g. the training stage's output"
        )
    model, config = load_model(model_dir)
    metadata = {
        META_BACKBONE: config["backbone"],
        META_KWARGS: json.dumps(config.get("kwargs") or {}, sort_keys=True),
    }
    return export_onnx(
        model, path, opset=opset, batch_size=batch_size, dynamic_batch=dynamic_batch, metadata=metadata
    )


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``faceops.*`` metadata of an exported file, JSON values decoded (weights are not loaded)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"ONNX file {path} is missing; export it with export_onnx or export_model_dir")
    proto = onnx.load_model(str(path), load_external_data=False)
    out: dict[str, Any] = {}
    for prop in proto.metadata_props:
        if not prop.key.startswith(META_PREFIX):
            continue
        try:
            out[prop.key] = prop.value if prop.key == META_BACKBONE else json.loads(prop.value)
        except ValueError as exc:
            raise DataError(f"{path}: metadata {prop.key!r} is not valid JSON ({exc}); export the file again") from exc
    return out


def onnx_session(path: str | os.PathLike) -> ort.InferenceSession:
    """A CPU onnxruntime session for the exported file ``path``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"ONNX file {path} is missing; export it with export_onnx or export_model_dir")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows of ``a`` and ``b`` (N, D), in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def onnx_parity(model: nn.Module, path: str | os.PathLike, n: int = 4, seed: int = 0) -> float:
    """Minimum cosine similarity between ``model`` (eval mode) and the ONNX file ``path`` run in
    onnxruntime, over ``n`` random inputs (:func:`random_inputs`, landmarks near the ArcFace template).

    A file exported with a fixed batch is run in batches of that size (so on ``n`` rounded up to a
    multiple of it); a dynamic-batch file takes all ``n`` at once.
    """
    _check_model(model)
    _positive_int(n, "onnx_parity n")
    session = onnx_session(path)
    inputs = session.get_inputs()
    names = [i.name for i in inputs]
    expected = [IMAGES, KEYPOINTS] if needs_keypoints(model) else [IMAGES]
    if names != expected:
        raise DataError(
            f"{path} has inputs {names} but {type(model).__name__} takes {expected}; export this model again"
        )
    fixed = inputs[0].shape[0]
    chunk = fixed if isinstance(fixed, int) else n
    total = -(-n // chunk) * chunk
    args = random_inputs(model, total, seed)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = model(*args).float().cpu().numpy()
    finally:
        model.train(was_training)
    feeds = [a.cpu().numpy() for a in args]
    outs = [
        session.run([EMBEDDINGS], {k: v[i : i + chunk] for k, v in zip(names, feeds)})[0]
        for i in range(0, total, chunk)
    ]
    return float(_cosine_rows(reference, np.concatenate(outs)).min())


__all__ = [
    "EMBEDDINGS",
    "IMAGES",
    "KEYPOINTS",
    "META_BACKBONE",
    "META_CONTRACT",
    "META_KWARGS",
    "export_model_dir",
    "export_onnx",
    "needs_keypoints",
    "onnx_parity",
    "onnx_session",
    "random_inputs",
    "read_metadata",
]
