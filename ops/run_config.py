"""Which configuration a run's params are, and whether the models it registers may become ``@candidate``.

``run_config`` compares ``params.yaml`` with the one committed at git ``HEAD``: the default, a ``presets.yaml`` preset
or a custom delta (the user's data paths aside). ``promotable`` is the registry rule every entry point goes through
(``faceops run``, ``dvc repro``, ``dvc exp run``, a deployment: they all register through ``ops.tracking``): only the
default and non-toy presets move ``@candidate``; ``FACEOPS_MOVE_ALIASES`` overrides it (``alias_policy``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# "1": always move a new version's alias (`@candidate`), "0": never, unset: the run's configuration decides
ENV_MOVE_ALIASES = "FACEOPS_MOVE_ALIASES"


def alias_policy() -> bool | None:
    """``FACEOPS_MOVE_ALIASES``: ``1`` moves a new version's alias (``@candidate``) whatever the run's params, ``0``
    never does, unset (or ``auto``) leaves it to the run's configuration (``promotable``)."""
    value = os.environ.get(ENV_MOVE_ALIASES, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return None


# presets whose models are toys: registered and tagged, never moved to @candidate
TOY_PRESETS = ("smoke",)
# params keys that name the user's data, not the recipe: a default or preset run on other data keeps its config
DATA_KEYS = ("data.ingest_folder", "data.ingest_recordio")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def run_config(root: Path) -> dict[str, str]:
    """Which configuration ``root``'s ``params.yaml`` is, against the one committed at git HEAD: tags
    ``faceops.config`` — ``default`` (the same, data paths aside), ``preset:<name>`` (exactly a ``presets.yaml``
    delta), ``custom`` (any other delta, listed in ``faceops.config_delta``) or ``unknown`` (no params.yaml or no
    git history to compare with) — and ``faceops.params_digest`` (SHA-256 of the params file)."""
    import hashlib

    import yaml

    params = Path(root) / "params.yaml"
    if not params.is_file():
        return {"faceops.config": "unknown"}
    text = params.read_bytes()
    tags = {"faceops.config": "unknown", "faceops.params_digest": hashlib.sha256(text).hexdigest()}
    head = subprocess.run(["git", "show", "HEAD:./params.yaml"], cwd=root, capture_output=True)
    if head.returncode != 0:
        return tags
    now, base = _flat(yaml.safe_load(text) or {}), _flat(yaml.safe_load(head.stdout) or {})
    delta = {k: v for k, v in now.items() if base.get(k, object()) != v and k not in DATA_KEYS}
    delta.update({k: None for k in base if k not in now})
    if not delta:
        return {**tags, "faceops.config": "default"}
    presets_file = Path(root) / "presets.yaml"
    presets = yaml.safe_load(presets_file.read_text()) if presets_file.is_file() else {}
    for name, values in (presets or {}).items():
        expected = {k: v for k, v in (values or {}).items() if base.get(k, object()) != v}
        if expected == delta:
            return {**tags, "faceops.config": f"preset:{name}"}
    shown = ", ".join(f"{k}={v}" for k, v in sorted(delta.items()))
    return {**tags, "faceops.config": "custom", "faceops.config_delta": shown[:500]}


def config_label(config: dict[str, str]) -> str:
    """A run name's suffix for a ``run_config``: "" for the default (or unknown), ``preset:smoke``, or ``custom
    fr.epochs=2, …`` (shortened), so runs of toy and custom configurations stand apart in the runs table."""
    kind = config.get("faceops.config", "unknown")
    if kind in ("default", "unknown"):
        return ""
    delta = config.get("faceops.config_delta", "")
    return f"{kind} {delta[:60]}{'…' if len(delta) > 60 else ''}".strip()


def promotable(config: str) -> bool:
    """Whether a model of ``config`` (a ``faceops.config`` tag) may move ``@candidate``: the default, a preset that
    is not a toy, or an unknown configuration (a folder that is not a faceops project)."""
    return config in ("default", "unknown") or (config.startswith("preset:")
                                                 and config.split(":", 1)[1] not in TOY_PRESETS)
