"""Models on disk: one directory with ``model.safetensors`` and ``config.json``.

``config.json`` holds everything needed to rebuild the network without the training code's params::

    {"format": 1, "backbone": "vit_tiny", "kwargs": {...constructor overrides...},
     "input_contract": {...}, "extra": {...e.g. training data digest, metrics...}}

Writes are atomic: both files go to a temporary sibling directory that then replaces ``model_dir``.

``write_model_dir`` / ``read_model_config`` / ``load_weights_into`` implement that layout for any model;
the FaceGCD, CAFace and DFA aligner save/load functions use them with their own ``config.json`` keys.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ml.atomic import remove_dead_temporaries
from ml.errors import ConfigError, DataError
from ml.fr.backbones import BACKBONES, build_backbone, input_contract

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ONNX_BACKBONE, ONNX_FILE = "onnx", "model.onnx"  # an imported ONNX recogniser's directory (``ml.models.onnx_embedder``)
FORMAT = 1

M = TypeVar("M", bound=nn.Module)


def _json_ready(value: Any, what: str) -> Any:
    """Round-trip ``value`` through JSON so what is saved is exactly what loads (tuples → lists)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be JSON-serialisable plain values: {exc}") from exc


def write_model_dir(model_dir: str | os.PathLike, model: nn.Module, config: dict[str, Any], *, what: str) -> Path:
    """Write ``model``'s weights and ``config`` to ``model_dir`` atomically; return it.

    ``config`` must be JSON-serialisable plain values (else :class:`ConfigError`). Both files go to a temporary
    sibling directory that then replaces ``model_dir``, so readers never see a half-written model. ``what``
    names the model in messages and the log line.
    """
    text = json.dumps(_json_ready(config, f"{what} config"), indent=2, sort_keys=True) + "\n"
    # safetensors refuses shared or non-contiguous storage: store an independent contiguous copy.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}

    model_dir = Path(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.{os.getpid()}.", suffix=".tmp", dir=model_dir.parent))
    try:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(text)
        old = None
        if model_dir.exists():
            old = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.old")
            os.replace(model_dir, old)
        os.replace(tmp, model_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved %s (%d tensors) to %s", what, len(state), model_dir)
    return model_dir


def read_model_config(model_dir: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """The parsed ``config.json`` of ``model_dir``; :class:`DataError` naming the file if either file is missing,
    the JSON is unreadable, or it is not an object. ``what`` names the kind of model directory expected."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG
    if not config_path.is_file():
        raise DataError(f"model file {config_path} is missing; a {what} directory needs {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{config_path} is not valid JSON: {exc}; re-save the {what}") from exc
    if not isinstance(config, dict):
        raise DataError(f"{config_path} holds {type(config).__name__}, not a JSON object; re-save the {what}")
    weights = ONNX_FILE if config.get("backbone") == ONNX_BACKBONE else WEIGHTS  # an imported ONNX recogniser
    if not (model_dir / weights).is_file():
        raise DataError(f"model file {model_dir / weights} is missing; a {what} directory needs {CONFIG} and {weights}")
    return config


def load_weights_into(model: M, model_dir: str | os.PathLike, *, what: str) -> M:
    """Load ``model_dir``'s ``model.safetensors`` into ``model`` (strictly) and return it in eval mode.

    :class:`DataError` naming the file if it is unreadable or its keys/shapes do not match ``model`` (built from
    ``config.json``; ``what`` describes it, e.g. ``"vit_tiny({...})"``).
    """
    model_dir = Path(model_dir)
    config_path, weights_path = model_dir / CONFIG, model_dir / WEIGHTS
    try:
        state = load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise DataError(f"{weights_path} is not a readable safetensors file: {exc}; re-save the model") from exc
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise DataError(
            f"{weights_path} does not match {what} in {config_path}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}; "
            f"the two files must come from the same save"
        )
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def save_model(
    model_dir: str | os.PathLike,
    model: nn.Module,
    *,
    backbone: str,
    kwargs: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (built as ``build_backbone(backbone, **kwargs)``) to ``model_dir``; return it."""
    if backbone not in BACKBONES:
        raise ConfigError(f"unknown backbone {backbone!r}; valid names: {', '.join(BACKBONES)}")
    config = {
        "format": FORMAT,
        "backbone": backbone,
        "kwargs": _json_ready(dict(kwargs), "model kwargs"),
        "input_contract": _json_ready(input_contract(model), "input contract"),
        "extra": _json_ready(dict(extra or {}), "model extra"),
    }
    return write_model_dir(model_dir, model, config, what=backbone)


def load_model(model_dir: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model saved in ``model_dir``; return it in eval mode with its config dict."""
    config = read_model_config(model_dir, what="model")
    config_path = Path(model_dir) / CONFIG
    if not isinstance(config.get("backbone"), str):
        raise DataError(f"{config_path} has no 'backbone' name; re-save the model with save_model")
    name = config["backbone"]
    from ml.models.onnx_embedder import OnnxEmbedder

    if name == ONNX_BACKBONE:  # an imported ONNX recogniser (``ml.models.onnx_embedder``): the graph, not safetensors
        pixels = config.get("kwargs") or {}
        try:
            return OnnxEmbedder(Path(model_dir) / ONNX_FILE, **pixels).eval(), config
        except TypeError as exc:
            raise DataError(f"{config_path}: 'kwargs' {pixels!r} is not an ONNX pixel contract (colour, mean, "
                            f"std); import the model again with `faceops import`") from exc
    if name not in BACKBONES:
        raise DataError(f"{config_path} names backbone {name!r}, which is not registered ({', '.join(BACKBONES)})")
    kwargs = config.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DataError(f"{config_path}: 'kwargs' must be a mapping, got {kwargs!r}")
    try:
        model = build_backbone(name, **kwargs)
    except ConfigError as exc:
        raise DataError(f"{config_path}: cannot build {name!r} from its kwargs: {exc}") from exc
    return load_weights_into(model, model_dir, what=f"{name}({kwargs})"), config


__all__ = [
    "CONFIG",
    "WEIGHTS",
    "load_model",
    "load_weights_into",
    "read_model_config",
    "save_model",
    "write_model_dir",
]
