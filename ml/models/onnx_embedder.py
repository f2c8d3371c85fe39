"""An ONNX face recogniser behind the interface of a faceops backbone (``OnnxEmbedder``), for imported models.

``ml.fr.pretrained`` imports such graphs; ``ml.models.io.load_model`` loads them back from a model directory
(``backbone: onnx``, ``model.onnx``).

CAFace fuses a backbone's features with *styles*, the per-channel spatial mean and std of intermediate maps
(``ml.fr.backbones.iresnet.channel_style``). A graph returns only its embedding, so ``styles`` names intermediate
tensors of the graph (NCHW maps) that are made graph outputs in memory; their styles are concatenated in the order
named, ``style_dim`` = the sum of their channels. For OpenCV Zoo's SFace (a MobileFaceNet) ``ml.fr.pretrained``
names ``conv_6_relu`` (256 × 28 × 28) and ``conv_12_relu`` (512 × 14 × 14), the maps at the resolutions of the
IResNet stages CAFace's reference code taps (layer2 and layer3 at 28 and 14 px).

Differences from the references: the graph's batch dimension is made symbolic in memory (SFace's file fixes it at 1)
and initialisers listed as graph inputs are dropped, so onnxruntime can fold them; the file on disk stays the
user's, byte for byte (its sha256 is the provenance).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ml.errors import ConfigError, DataError
from ml.fr.backbones.iresnet import channel_style

# the project's own tensor, what OnnxEmbedder.forward takes: RGB (x/255 − 0.5)/0.5
PROJECT_CONTRACT = {"colour": "RGB", "scale": "x/255", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
                    "layout": "NCHW float32"}


def onnx_graph(path: Path, taps: Sequence[str] = ()) -> Any:
    """The ONNX model at ``path`` with a symbolic batch dimension, no initialisers among its inputs, and the
    intermediate tensors ``taps`` added as outputs after its own."""
    import onnx

    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError… for a file that is not ONNX
        raise DataError(f"{path} is not a readable ONNX file ({type(exc).__name__}: {exc}); give the recogniser's "
                        f".onnx file") from exc
    initialisers = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in initialisers]
    del proto.graph.input[:]
    proto.graph.input.extend(inputs)
    for value in (*proto.graph.input, *proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        if len(dims) > 0:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = "batch"
    produced = [o for node in proto.graph.node for o in node.output]
    missing = [name for name in taps if name not in produced]
    if missing:
        raise ConfigError(f"{path} has no tensor named {missing}: name intermediate maps its nodes produce, e.g. "
                          f"{produced[len(produced) // 3: len(produced) // 3 + 4]} (list them with "
                          f"`python -c \"import onnx; print([o for n in onnx.load('{path}').graph.node for o in "
                          f"n.output])\"`)")
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in taps)
    return proto


class OnnxEmbedder(nn.Module):
    """An ONNX face recogniser behind the interface of a faceops backbone.

    ``forward`` takes the project's tensor ``(B, 3, S, S)``, RGB ``(x/255 − 0.5)/0.5`` (``input_contract``, what
    ``ml.fr.train.embed`` makes of uint8 faces), undoes it to 0–255 pixels, reorders the channels and applies the
    graph's ``(x − mean)/std`` (``source_contract``), and returns the graph's first output ``(B, D)`` as a tensor;
    with ``return_styles`` also the styles ``(B, style_dim, 2)`` of the ``styles`` tensors (a graph imported without
    them cannot give CAFace its styles: one clear error). It holds no trainable weights; an empty parameter gives
    callers a device (the CPU) to put tensors on.
    """

    needs_keypoints = False

    def __init__(self, path: str | Path, colour: str, mean: float, std: float, threads: int = 0,
                 styles: Sequence[str] = ()) -> None:
        super().__init__()
        import onnxruntime as ort

        path = Path(path)
        if colour not in ("RGB", "BGR"):
            raise ConfigError(f"ONNX recogniser colour must be 'RGB' or 'BGR', got {colour!r}")
        if not float(std) > 0:
            raise ConfigError(f"ONNX recogniser std must be > 0, got {std!r}")
        proto = onnx_graph(path, tuple(styles))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads or torch.get_num_threads()
        try:
            self.session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise DataError(f"onnxruntime cannot run {path}: {exc}") from exc
        graph_inputs = self.session.get_inputs()
        if len(graph_inputs) != 1:
            names = [i.name for i in graph_inputs]
            raise DataError(f"{path} has inputs {names}: an FR graph takes one image tensor (a KP-RPE export also "
                            f"takes keypoints: import its faceops model directory instead)")
        shape = graph_inputs[0].shape
        if len(shape) != 4 or shape[1] != 3 or not isinstance(shape[2], int) or shape[2] != shape[3]:
            raise DataError(f"{path}: input {graph_inputs[0].name!r} has shape {shape}; an FR graph takes "
                            f"(batch, 3, S, S) images with a fixed side S")
        out = self.session.get_outputs()[0]
        if len(out.shape) != 2 or not isinstance(out.shape[1], int):
            raise DataError(f"{path}: output {out.name!r} has shape {out.shape}; an FR graph returns (batch, D)")
        self.path, self.input_name, self.output_name = path, graph_inputs[0].name, out.name
        self.size, self.dim = int(shape[2]), int(out.shape[1])
        self.colour, self.mean, self.std = colour, float(mean), float(std)
        self._device = nn.Parameter(torch.zeros(0), requires_grad=False)
        self.styles, self.style_dim = tuple(styles), 0
        if self.styles:  # the maps' channels, from one run on a blank face
            maps = self.session.run(list(self.styles), {self.input_name: np.zeros((1, 3, self.size, self.size),
                                                                                  np.float32)})
            for name, value in zip(self.styles, maps):
                if value.ndim != 4:
                    raise ConfigError(f"{path}: style tensor {name!r} has shape {value.shape}; CAFace styles come from "
                                      f"(batch, C, H, W) maps")
            self.style_dim = sum(int(value.shape[1]) for value in maps)

    @property
    def input_contract(self) -> dict[str, Any]:
        styles = {"style_dim": self.style_dim} if self.styles else {}
        return {**PROJECT_CONTRACT, "size": self.size, "embedding_dim": self.dim, **styles}

    @property
    def source_contract(self) -> dict[str, Any]:
        """What the graph itself takes: colour order and ``(x − mean)/std`` of 0–255 pixels, NCHW."""
        return {"colour": self.colour, "mean": self.mean, "std": self.std, "size": self.size,
                "input": self.input_name}

    def forward(self, x: torch.Tensor, return_styles: bool = False) -> Any:
        if return_styles and not self.styles:
            raise ConfigError(f"{self.path} was imported without style tensors, so CAFace has no styles to fuse: "
                              f"import it again naming two intermediate maps (`faceops import … --styles A,B`), or "
                              f"import an arcface_torch checkpoint (IResNet/ViT) for fusion.fr_source")
        if x.ndim != 4 or x.shape[1:] != (3, self.size, self.size):
            raise DataError(f"{self.path} takes images of shape (B, 3, {self.size}, {self.size}), got "
                            f"{tuple(x.shape)}; resize the faces to its input size")
        pixels = (x.detach().float().cpu() * 0.5 + 0.5) * 255.0
        if self.colour == "BGR":
            pixels = pixels.flip(1)
        feed = ((pixels - self.mean) / self.std).contiguous().numpy()
        wanted = [self.output_name, *self.styles] if return_styles else [self.output_name]
        out, *maps = self.session.run(wanted, {self.input_name: feed})
        embedding = torch.from_numpy(np.asarray(out, dtype=np.float32)).to(x.device)
        if not return_styles:
            return embedding
        styles = torch.cat([channel_style(torch.from_numpy(np.asarray(m, dtype=np.float32))) for m in maps], dim=1)
        return embedding, styles.to(x.device)
