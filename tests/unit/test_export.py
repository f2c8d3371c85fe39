"""ONNX export: parity with PyTorch in onnxruntime, dynamic batch, the KP-RPE keypoint input, metadata, errors.

onnx and onnxruntime are project dependencies: a missing one fails this module at import, it is not skipped.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime  # noqa: F401  (a project dependency: fail here, not skip, when it is missing)
import pytest
import torch

from ml.errors import ConfigError, DataError
from ml.models import export as export_module
from ml.fr.backbones import build_backbone, input_contract
from ml.models.export import (
    EMBEDDINGS,
    IMAGES,
    KEYPOINTS,
    META_BACKBONE,
    META_CONTRACT,
    META_KWARGS,
    export_model_dir,
    export_onnx,
    onnx_parity,
    onnx_session,
    random_inputs,
    read_metadata,
)
from ml.models.io import save_model

VIT = dict(depth=1, dim=32, heads=2, embed_dim=16, drop_path=0.0)
CASES = {
    "vit_tiny": VIT,
    "vit_tiny_kprpe": VIT,
    "iresnet18": dict(img_size=32, width=0.125, embed_dim=16),
}
EXPORT_BATCH = 2
MIN_COSINE = 0.9999


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_backbone(name, **CASES[name]).eval()
    if getattr(model, "needs_keypoints", False):
        # The KP-RPE Linear starts at zero (keypoints ignored): random weights make the keypoint path
        # matter, with logits biases of a few units. A fresh ViT's attention branch is scaled down by
        # its 0.02-std projection; a 1/√dim one makes the attention, and so the keypoints, visible.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            linear = model.kprpe.linear
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 3.0)
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) * 0.5)
            for block in model.blocks:
                proj = block.attn.proj.weight
                proj.copy_(torch.randn(proj.shape, generator=gen) * proj.shape[1] ** -0.5)
    return model


_EXPORTS: dict[str, tuple] = {}


def _export(name: str, tmp_path_factory) -> tuple:
    """(name, model, path) of a dynamic-batch export, made once per backbone per session."""
    if name not in _EXPORTS:
        model = _build(name)
        path = export_onnx(model, tmp_path_factory.mktemp(name) / f"{name}.onnx", batch_size=EXPORT_BATCH)
        _EXPORTS[name] = (name, model, path)
    return _EXPORTS[name]


@pytest.fixture(params=sorted(CASES))
def exported(request, tmp_path_factory):
    return _export(request.param, tmp_path_factory)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _run(path, *arrays: torch.Tensor) -> np.ndarray:
    session = onnx_session(path)
    names = [i.name for i in session.get_inputs()]
    return session.run([EMBEDDINGS], {n: a.numpy() for n, a in zip(names, arrays)})[0]


def test_graph_interface(exported):
    name, model, path = exported
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) == 17
    inputs = {i.name: i for i in proto.graph.input}
    expected = [IMAGES, KEYPOINTS] if name.endswith("kprpe") else [IMAGES]
    assert list(inputs) == expected
    assert [o.name for o in proto.graph.output] == [EMBEDDINGS]
    size = model.input_contract["size"]

    def dims(value_info):
        return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]

    assert dims(inputs[IMAGES]) == ["batch", 3, size, size]
    if KEYPOINTS in inputs:
        assert dims(inputs[KEYPOINTS]) == ["batch", 5, 2]
    assert dims(proto.graph.output[0]) == ["batch", 16]
    for i in proto.graph.input:
        assert i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    meta = read_metadata(path)
    assert meta[META_CONTRACT] == json.loads(json.dumps(input_contract(model)))
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file was moved into place


@pytest.mark.parametrize("n", [EXPORT_BATCH, 3, 1])
def test_parity_at_several_batch_sizes(exported, n):
    _, model, path = exported
    assert onnx_parity(model, path, n=n, seed=n) >= MIN_COSINE


def test_kprpe_keypoints_change_the_onnx_output(tmp_path_factory):
    _, model, path = _export("vit_tiny_kprpe", tmp_path_factory)
    images, keypoints = random_inputs(model, 3, seed=5)
    shifted = keypoints + torch.tensor([6.0, -4.0])  # the whole face layout moves by a few pixels
    a, b = _run(path, images, keypoints), _run(path, images, shifted)
    with torch.no_grad():
        ref_a, ref_b = model(images, keypoints).numpy(), model(images, shifted).numpy()
    np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, ref_b, rtol=1e-5, atol=1e-5)
    # the keypoints move the ONNX embeddings far more than float noise and beyond the parity tolerance
    noise = max(np.abs(a - ref_a).max(), np.abs(b - ref_b).max())
    assert np.abs(a - b).max() > 100 * noise
    assert _cosine(a, b).min() < MIN_COSINE

def test_static_batch_export(tmp_path):
    model = _build("iresnet18")
    path = export_onnx(model, tmp_path / "static.onnx", batch_size=3, dynamic_batch=False)
    shape = onnx_session(path).get_inputs()[0].shape
    assert shape == [3, 3, 32, 32]
    assert onnx_parity(model, path, n=4) >= MIN_COSINE  # run as two batches of 3


def test_export_restores_train_mode(tmp_path):
    model = _build("vit_tiny").train()
    export_onnx(model, tmp_path / "m.onnx")
    assert model.training


def test_export_model_dir_writes_contract_and_config(tmp_path):
    model = _build("vit_tiny_kprpe")
    model_dir = save_model(tmp_path / "model", model, backbone="vit_tiny_kprpe", kwargs=VIT)
    path = export_model_dir(model_dir, tmp_path / "out" / "model.onnx")
    meta = read_metadata(path)
    assert meta[META_CONTRACT]["needs_keypoints"] is True
    assert meta[META_CONTRACT] == json.loads(json.dumps(input_contract(model)))
    assert meta[META_BACKBONE] == "vit_tiny_kprpe"
    assert meta[META_KWARGS] == VIT
    assert onnx_parity(model, path, n=3) >= MIN_COSINE


def test_export_model_dir_missing(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        export_model_dir(tmp_path / "nope", tmp_path / "m.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="config.json"):
        export_model_dir(tmp_path / "empty", tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_bad_arguments_raise_config_errors(tmp_path):
    model = _build("iresnet18")
    with pytest.raises(ConfigError, match="batch_size"):
        export_onnx(model, tmp_path / "m.onnx", batch_size=0)
    for opset in (11, 21, "17"):
        with pytest.raises(ConfigError, match="opset"):
            export_onnx(model, tmp_path / "m.onnx", opset=opset)
    with pytest.raises(ConfigError, match="directory"):
        export_onnx(model, tmp_path)
    with pytest.raises(ConfigError, match="nn.Module"):
        export_onnx(object(), tmp_path / "m.onnx")
    with pytest.raises(DataError, match="missing"):
        onnx_parity(model, tmp_path / "absent.onnx")


def test_parity_rejects_a_file_of_another_model(exported, tmp_path):
    name, _, path = exported
    other = "vit_tiny" if name.endswith("kprpe") else "vit_tiny_kprpe"
    with pytest.raises(DataError, match="inputs"):
        onnx_parity(_build(other), path)


def test_failed_export_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous export")

    def broken(*args, **kwargs):
        raise RuntimeError("exporter failed")

    monkeypatch.setattr(export_module.onnx, "save_model", broken)
    with pytest.raises(RuntimeError, match="exporter failed"):
        export_onnx(_build("iresnet18"), path)
    assert path.read_bytes() == b"previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]

