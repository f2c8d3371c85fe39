"""Registry of face backbones: name → builder taking constructor overrides as keyword arguments.

Every backbone maps ``(B, 3, S, S)`` float images to ``(B, embedding_dim)`` unnormalised embeddings
and exposes ``input_contract`` (size, colour, mean/std, layout, embedding dim). The ViTs follow insightface
(https://github.com/deepinsight/insightface, ``recognition/arcface_torch``) as LVFace does; the ``*_kprpe`` variants add
KP-RPE (https://arxiv.org/abs/2403.14852, reference code https://github.com/mk-minchul/CVLface).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ml.errors import ConfigError
from ml.fr.backbones.iresnet import iresnet18, iresnet34, iresnet50, iresnet100
from ml.fr.backbones.kprpe import vit_b_kprpe, vit_s_kprpe, vit_t_kprpe, vit_tiny_kprpe
from ml.fr.backbones.vit import vit_b, vit_l, vit_s, vit_t, vit_tiny

BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "vit_tiny": vit_tiny,
    "vit_t": vit_t,
    "vit_s": vit_s,
    "vit_b": vit_b,
    "vit_l": vit_l,
    "vit_tiny_kprpe": vit_tiny_kprpe,
    "vit_t_kprpe": vit_t_kprpe,
    "vit_s_kprpe": vit_s_kprpe,
    "vit_b_kprpe": vit_b_kprpe,
    "iresnet18": iresnet18,
    "iresnet34": iresnet34,
    "iresnet50": iresnet50,
    "iresnet100": iresnet100,
}


def _builder(name: str) -> Callable[..., nn.Module]:
    if name not in BACKBONES:
        raise ConfigError(f"unknown backbone {name!r}; valid names: {', '.join(BACKBONES)}")
    return BACKBONES[name]


def build_backbone(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered backbone ``name`` with constructor overrides ``kwargs``."""
    builder = _builder(name)
    try:
        return builder(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"backbone {name!r} does not accept arguments {sorted(kwargs)}: {exc}") from exc


def input_contract(name_or_model: str | nn.Module, **overrides: Any) -> dict[str, Any]:
    """Input contract of a built model, or of registry entry ``name`` with ``overrides``.

    For a name the model is instantiated on the ``meta`` device, so no weights are allocated.
    """
    if isinstance(name_or_model, str):
        builder = _builder(name_or_model)
        with torch.device("meta"):
            model = builder(**overrides)
    else:
        model = name_or_model
    contract = getattr(model, "input_contract", None)
    if contract is None:
        raise ConfigError(f"{type(model).__name__} declares no input_contract; add one beside its class")
    return dict(contract)
