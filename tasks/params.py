"""Params deltas: ``--set fr.epochs=2`` and named presets, checked before anything runs.

A delta is applied to ``params.yaml`` in place, as ``dvc exp run -S`` applies one: DVC then sees the changed params
and reruns the stages that read them; ``git checkout params.yaml`` undoes it. ``KEY=VALUE`` takes a YAML value, as
DVC's override does for these forms; DVC's ``+KEY`` / ``~KEY`` (add or delete a key) are refused, since every key
is already declared by its section's dataclass.

Why not DVC's own writer (``dvc.utils.hydra.apply_overrides``): it re-serialises the whole file, so one ``-S``
rewrites every flow-style list, ``null`` and quoted string of params.yaml (about 60 lines for ``fr.epochs=2``) and
the diff no longer shows the experiment. Here only the lines of the keys being set change; comments, ``null``,
quoting and alignment are kept byte for byte. The paths the stages read (``INPUT_PATHS``) must exist before the delta
is written.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ml.atomic import atomic_path
from ml.config import from_mapping
from ml.errors import ConfigError
from tasks import PARAM_SECTIONS
from tasks.common import ParamsLoader, load_yaml, yaml_error

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
        if key[:1] in ("+", "~"):
            raise ConfigError(f"--set '{item}': adding or deleting a key (DVC's +KEY / ~KEY) is not supported: every "
                              "params key is declared by its section; set an existing one, e.g. --set fr.epochs=2")
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


# Params naming a file or folder that must exist before any stage starts: key → (kind, what it must hold, value
# that turns it off). Each is read by the stage in the comment; "" / null means "not used".
INPUT_PATHS: dict[str, tuple[str, str, str]] = {
    "data.ingest_folder": ("dir", "an image folder laid out as <identity>/<image>", '""'),  # tasks/prepare
    "data.ingest_recordio": ("file", "an InsightFace train.rec with train.idx beside it", '""'),  # tasks/prepare
    "aligner.reference_faces": ("dir", "a folder <identity>/<image> of real aligned faces", '""'),  # train_aligner
    "generator.autoencoder": ("dir", "a diffusers VQModel/AutoencoderKL/AutoencoderTiny folder (save_pretrained)",
                              "null"),  # tasks/train_generator.py
    "evaluate.bin_dir": ("dir", "a folder of InsightFace verification .bin files (lfw.bin, ...)",
                         '""'),  # tasks/evaluate
    "evaluate.ijb_dir": ("dir", "an IJB-B/C folder (meta/ + loose_crop/) or the folder holding IJBB/ and IJBC/",
                         '""'),  # tasks/evaluate
}


def check_input_paths(params: Mapping[str, Any], root: Path) -> None:
    """Every set ``INPUT_PATHS`` key names an existing file or folder (relative paths from ``root``, where the
    stages run), or ConfigError naming each key, its path and what to do."""
    problems = []
    for key, (kind, what, off) in INPUT_PATHS.items():
        value = lookup(params, key.split("."))
        if not value or not isinstance(value, str):  # off, or a wrong type that check_params reports
            continue
        path = Path(value)
        found = (root / path).is_dir() if kind == "dir" else (root / path).is_file()
        if not found:
            where = "" if path.is_absolute() else f" (relative to {root})"
            missing = "is not a directory" if kind == "dir" else "is not a file"
            problems.append(f"{key}: {value}{where} {missing}; point it at {what}, or set {key}={off} to turn it "
                            "off")
    if problems:
        raise ConfigError(" ".join(problems) if len(problems) == 1 else
                          "input paths not found:\n  " + "\n  ".join(problems))


def apply_delta(params_path: Path, delta: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set each dotted key in ``params_path``, editing only those keys' lines; check the result (keys, types,
    ``INPUT_PATHS``) before writing it atomically. Returns {key: (old, new)}."""
    params_path = Path(params_path)
    text = params_path.read_bytes().decode("utf-8")  # bytes: CRLF line ends stay as they are
    changes: dict[str, tuple[Any, Any]] = {}
    try:
        for key, value in delta.items():
            changes[key] = (lookup(load_yaml(text) or {}, key.split(".")), value)
            text = set_key(text, key, value)
        params = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{params_path}: not valid YAML ({yaml_error(exc)}). Fix the file or "
                          f"`git checkout {params_path.name}`.") from exc
    for key, value in delta.items():  # what was written reads back as the value (NaN included: compared as YAML)
        assert _flow(lookup(params, key.split("."))) == _flow(value), key
    check_params(params)
    check_input_paths(params, params_path.parent)
    write_params(params_path, text.encode("utf-8"))
    return changes


def write_params(params_path: Path, content: bytes) -> None:
    """Replace ``params_path`` with ``content`` (a temporary sibling, then a rename: never half-written)."""
    with atomic_path(params_path) as tmp:
        tmp.write_bytes(content)


class ParamsUndo:
    """``params.yaml``'s bytes before a run, put back if the run fails after a delta was written (unless the file
    changed again since: that edit is someone else's)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.original = self.path.read_bytes() if self.path.is_file() else None
        self._written: bytes | None = None

    def written(self) -> None:
        """Call after writing the delta: what is in the file now is this run's."""
        self._written = self.path.read_bytes()

    def restore(self) -> bool:
        """Put the original bytes back (temporary file + rename); → whether the file was changed back."""
        if self.original is None or self._written is None or self._written == self.original:
            return False
        if not self.path.is_file() or self.path.read_bytes() != self._written:
            return False
        write_params(self.path, self.original)
        return True


def set_key(text: str, key: str, value: Any) -> str:
    """``text`` (a params YAML document) with the dotted ``key`` set to ``value``; only the key's own lines change.

    The value is written in YAML flow style on the key's line, before the line's comment (kept at its column). A key
    missing from its block mapping is added as that mapping's last line. Below a value that is not a block mapping
    (``procedural: {}``, ``null``) the value is merged: ``data.procedural.blur_prob=0.3`` → ``procedural: {blur_prob:
    0.3}``. Setting below a plain value (``fr.epochs.x``) raises ConfigError.
    """
    lines = text.split("\n")  # PyYAML's marks count lines the same way ("\r\n" keeps its "\r" in the line)
    parts = key.split(".")
    node = yaml.compose(text, Loader=ParamsLoader)
    if node is None:  # an empty document
        head = text if not text or text.endswith("\n") else text + "\n"
        return f"{head}{parts[0]}: {_flow(_nest(parts[1:], value))}\n"
    for depth, part in enumerate(parts):
        if not isinstance(node, yaml.MappingNode) or node.flow_style:
            where = f"params key '{'.'.join(parts[:depth])}'" if depth else "the top level"
            raise ConfigError(f"{where} is not a block mapping (one `key:` per line); cannot set '{key}'.")
        pair = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        if pair is None:
            if depth == 0:
                section_class(part)  # unknown section → ConfigError naming it
            return _insert(lines, node, part, _nest(parts[depth + 1:], value))
        key_node, value_node = pair
        if depth == len(parts) - 1:
            return _replace(lines, key_node, value_node, value)
        if isinstance(value_node, yaml.MappingNode) and not value_node.flow_style:
            node = value_node
            continue
        current = lookup(load_yaml(text), parts[: depth + 1])
        if current is None:
            current = {}
        if not isinstance(current, dict):
            raise ConfigError(f"params key '{'.'.join(parts[: depth + 1])}' is not a section; cannot set '{key}'.")
        return _replace(lines, key_node, value_node, _merge(current, parts[depth + 1:], value))
    raise AssertionError("unreachable")


def _replace(lines: list[str], key_node: Any, value_node: Any, value: Any) -> str:
    """Lines with ``key_node``'s value replaced by ``value`` on the key's line, its comment kept."""
    first = key_node.start_mark.line
    line = lines[first]
    colon = line.index(":", key_node.end_mark.column)
    inline = value_node.start_mark.line == first and not _empty(value_node)
    if inline:  # a scalar or flow collection after the key: its comment follows it on the line where it ends
        last = _last_line(value_node)
        rest = lines[last][value_node.end_mark.column:] if value_node.end_mark.line == last else ""
        comment_col = len(lines[last]) - len(rest.lstrip(" \t"))
    else:  # nothing, or a block below the key: the key's line holds the comment
        last = first if _empty(value_node) else _last_line(value_node)
        rest = line[colon + 1:]
        comment_col = colon + 1 + len(rest) - len(rest.lstrip(" \t"))
    comment = rest.strip(" \t\r")
    eol = "\r" if lines[last].endswith("\r") else ""
    new = f"{line[:colon + 1]} {_flow(value)}"
    if comment:
        new = f"{new.ljust(comment_col - 1)} {comment}"
    return "\n".join(lines[:first] + [new + eol] + lines[last + 1:])


def _insert(lines: list[str], mapping: Any, key: str, value: Any) -> str:
    """Lines with ``key: value`` added after the last line of the block ``mapping``, at its keys' indentation."""
    indent = mapping.value[0][0].start_mark.column
    last = _last_line(mapping)
    eol = "\r" if lines[last].endswith("\r") else ""
    new = f"{' ' * indent}{key}: {_flow(value)}{eol}"
    return "\n".join(lines[: last + 1] + [new] + lines[last + 1:])


def _last_line(node: Any) -> int:
    """The last line holding part of ``node`` (block collections: their last entry; comments after it excluded)."""
    if isinstance(node, yaml.MappingNode) and not node.flow_style:
        return max(_last_line(k) if _empty(v) else _last_line(v) for k, v in node.value)
    if isinstance(node, yaml.SequenceNode) and not node.flow_style:
        return max(_last_line(item) for item in node.value)
    end = node.end_mark  # just past the scalar or the closing bracket; column 0 for a block scalar's final break
    return end.line - 1 if end.column == 0 and end.line > node.start_mark.line else end.line


def _empty(node: Any) -> bool:
    """``key:`` with nothing after it (null): PyYAML marks it where the next token starts."""
    return isinstance(node, yaml.ScalarNode) and node.style is None and node.value == ""


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style): ``2``, ``[4, 12]``, ``{blur_prob: 0.3}``, ``''``, ``null``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True, sort_keys=False)
    text = text.removesuffix("\n...\n").rstrip("\n")
    if "\n" in text:  # a string with line breaks: one double-quoted line (JSON's escapes are YAML's)
        text = json.dumps(value, ensure_ascii=False)
    return text


def lookup(params: Any, parts: list[str]) -> Any:
    """The value at the dotted key split into ``parts`` (``["fr", "lr"]``), or None where the key is missing."""
    for part in parts:
        if not isinstance(params, Mapping):
            return None
        params = params.get(part)
    return params


def _nest(parts: list[str], value: Any) -> Any:
    return value if not parts else {parts[0]: _nest(parts[1:], value)}


def _merge(current: dict[str, Any], parts: list[str], value: Any) -> dict[str, Any]:
    merged = dict(current)
    inner = merged.get(parts[0])
    merged[parts[0]] = (_merge(inner if isinstance(inner, dict) else {}, parts[1:], value) if len(parts) > 1
                        else value)
    return merged
