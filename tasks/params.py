"""Params deltas: ``--set fr.epochs=2`` and named presets, checked before anything runs.

A delta is applied to ``params.yaml`` in place (comments kept), exactly like ``dvc exp run -S``: DVC then
sees the changed params and reruns the stages that read them. ``git checkout params.yaml`` undoes it.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ml.config import from_mapping
from ml.errors import ConfigError
from tasks import PARAM_SECTIONS
from tasks.common import atomic_path, load_yaml

PRESETS_FILE = "presets.yaml"


def section_class(name: str) -> type:
    if name not in PARAM_SECTIONS:
        raise ConfigError(f"unknown params section '{name}'. Valid sections: {', '.join(sorted(PARAM_SECTIONS))}.")
    module, cls = PARAM_SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def check_params(params: Mapping[str, Any]) -> None:
    """Every section known and every key valid, or ConfigError naming the key."""
    for name, value in params.items():
        from_mapping(section_class(name), value or {}, name)


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["fr.epochs=2", "evaluate.fars=[0.01]"]`` → ``{"fr.epochs": 2, "evaluate.fars": [0.01]}`` (YAML values)."""
    delta: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key:
            raise ConfigError(f"--set '{item}': expected SECTION.KEY=VALUE, e.g. --set fr.epochs=2")
        try:
            delta[key] = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set '{item}': the value is not valid YAML ({exc}).") from exc
    return delta


def load_preset(name: str, root: Path) -> dict[str, Any]:
    path = root / PRESETS_FILE
    presets = load_yaml(path.read_text()) if path.is_file() else {}
    if not presets or name not in presets:
        valid = ", ".join(sorted(presets or {})) or "none"
        raise ConfigError(f"unknown preset '{name}' (defined in {path}: {valid}).")
    return dict(presets[name])


def apply_delta(params_path: Path, delta: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set each dotted key in ``params_path``; validate the result; write atomically. Returns {key: (old, new)}."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.preserve_quotes = True
    doc = rt.load(params_path.read_text())
    changes: dict[str, tuple[Any, Any]] = {}
    for key, value in delta.items():
        parts = key.split(".")
        node = doc
        for depth, part in enumerate(parts[:-1]):
            if part not in node or node[part] is None:
                if depth == 0:
                    section_class(part)  # unknown section → ConfigError naming it
                node[part] = {}
            node = node[part]
            if not isinstance(node, Mapping):
                raise ConfigError(f"params key '{'.'.join(parts[: depth + 1])}' is not a section; cannot set '{key}'.")
        old = node.get(parts[-1])
        node[parts[-1]] = value
        changes[key] = (old, value)
    check_params(load_yaml(_dump(rt, doc)))
    with atomic_path(params_path) as tmp:
        tmp.write_text(_dump(rt, doc))
    return changes


def _dump(rt: Any, doc: Any) -> str:
    buf = io.StringIO()
    rt.dump(doc, buf)
    return buf.getvalue()
