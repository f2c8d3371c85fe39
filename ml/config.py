"""Typed views of ``params.yaml`` sections.

Each stage's section maps onto a frozen dataclass declared beside its consumer. ``from_mapping``
rejects unknown keys and wrong types with a message naming the full key (``fr.epochs``), so a typo
in ``params.yaml`` or in ``--set`` fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ml.errors import ConfigError

T = TypeVar("T")

# an unknown key named like one of these is a credential someone tried to put into params.yaml
_CREDENTIAL_WORDS = ("password", "passwd", "secret", "access_key", "accesskey", "token", "credential", "api_key",
                     "apikey", "private_key", "privatekey")


def _check_type(value: Any, annotation: Any, key: str) -> Any:
    """Return ``value`` converted to ``annotation`` where lossless, else raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"params key '{key}': got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"params key '{key}': {value!r} is not one of {list(args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"params key '{key}': expected a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"params key '{key}': expected {len(args)} items, got {len(value)}")
            return tuple(_check_type(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        conv = [_check_type(v, args[0], f"{key}[{i}]") if args else v for i, v in enumerate(value)]
        return tuple(conv) if origin is tuple else conv
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"params key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"params key '{key}': expected true/false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"params key '{key}': expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"params key '{key}': expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"params key '{key}': expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(annotation):
        return from_mapping(annotation, value, key)
    return value


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, section: str) -> T:
    """Build the frozen dataclass ``cls`` from ``mapping`` (a params section named ``section``).

    Missing keys take the dataclass defaults; unknown keys and wrong types raise ConfigError naming
    ``section.key`` and, for a likely typo, the nearest valid key.
    """
    mapping = {} if mapping is None else mapping
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"params section '{section}' must be a mapping, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in mapping if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        if not close and any(word in str(key).lower().replace("-", "_") for word in _CREDENTIAL_WORDS):
            where = getattr(cls, "CREDENTIALS_FROM", "the environment")
            raise ConfigError(
                f"params key '{section}.{key}' looks like a credential: credentials never go into params.yaml (it is "
                f"versioned, and every stage logs its params to MLflow). Remove it and provide it through {where}."
            )
        hint = f" Did you mean '{section}.{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown params key '{section}.{key}'.{hint} Valid keys: {', '.join(sorted(fields))}."
        )
    kwargs = {}
    for name, value in mapping.items():
        kwargs[name] = _check_type(value, hints[name], f"{section}.{name}")
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(f"params section '{section}' is missing required key(s): {', '.join(missing)}")
    return cls(**kwargs)


def to_flat_dict(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a (nested) dataclass into ``{"section.key": value}`` for logging."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(to_flat_dict(value, key + "."))
        else:
            out[key] = value
    return out
