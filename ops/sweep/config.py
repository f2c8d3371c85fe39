"""The ``sweep:`` section of ``params.yaml`` (``SweepConfig``), its search space checked against each stage's config
before any trial (``check_space``), and the Optuna storage it names (``StorageSpec``). See ``ops/sweep``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import time
import types
import typing
import urllib.parse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ml.config import _check_type, from_mapping
from ml.errors import ConfigError, FaceopsError
from ops.sweep.targets import OBJECTIVES, SweepTarget
from tasks.common import redact, section

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
KINDS = ("float", "int", "categorical")
DIRECTIONS = ("maximize", "minimize")
ENV_STORAGE = "FACEOPS_SWEEP_STORAGE"  # a storage URL from the environment (e.g. a secret), between --storage and params
STORAGE_FILE = "optuna.db"
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "pg8000": "pg8000",
                   "pymysql": "pymysql", "MySQLdb": "mysqlclient"}
URL_SCHEMES = re.compile(r"^(sqlite|postgresql|mysql)(\+\w+)?://")


class SweepError(FaceopsError, RuntimeError):
    """The sweep cannot run: storage or tracking unreachable, a worker failed, nothing to apply."""


# ── the sweep: section of params.yaml ─────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class ParamRange:
    """One search dimension, ``sweep.<stage>.space.<params key>``: ``float``/``int`` from ``low`` to ``high``
    (``log`` scale, or a ``step`` grid), or ``categorical`` over ``choices`` (numbers, strings, booleans)."""

    type: str = "float"
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None


@dataclass(frozen=True)
class StageSweep:
    """``sweep.<stage>``: what one stage's sweep optimises and over what."""

    metric: str = "val/accuracy"  # reported by the trial after every epoch; the last value is the trial's value
    direction: str = "maximize"
    trials: int = 20  # per command (``--trials``); processes sharing a study each run their own
    fixed: dict[str, Any] = field(default_factory=dict)  # params key → value for every trial, never written back
    space: dict[str, Any] = field(default_factory=dict)  # params key → ParamRange mapping


@dataclass(frozen=True)
class SweepConfig:
    """``params.yaml`` section ``sweep``: study settings, then one ``StageSweep`` per key of ``OBJECTIVES``."""

    storage: str = ""  # "" = sqlite:///optuna.db in the repository | journal:<file> | postgresql://user@host/db
    sampler: str = "tpe"
    pruner: str = "median"
    startup_trials: int = 5  # random trials before TPE models the space; completed trials before pruning starts
    warmup_epochs: int = 1  # epochs every trial runs before the median pruner may stop it
    seed: int = 0
    heartbeat_s: int = 60  # SQL storages: a trial silent for 3 heartbeats (killed worker) is failed and retried; 0 = off
    baseline: bool = True  # a new study's first trial runs params.yaml's own values: the sweep's bar to beat
    train_fr: StageSweep = field(default_factory=StageSweep)
    train_aligner: StageSweep = field(default_factory=lambda: StageSweep(metric="val/nme_box", direction="minimize"))
    train_discovery: StageSweep = field(default_factory=StageSweep)
    train_fusion: StageSweep = field(default_factory=lambda: StageSweep(metric="val/rank1"))
    train_generator: StageSweep = field(default_factory=lambda: StageSweep(metric="val/objective"))

    def __post_init__(self) -> None:
        for key, valid in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
            if getattr(self, key) not in valid:
                raise ConfigError(f"params key 'sweep.{key}': {getattr(self, key)!r} is not one of {list(valid)}")
        for key in ("startup_trials", "warmup_epochs", "heartbeat_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"params key 'sweep.{key}' = {getattr(self, key)} must be ≥ 0")
        check_storage_text(self.storage, "sweep.storage", allow_password=False)
        for stage in OBJECTIVES:
            self.ranges(stage)

    def stage(self, name: str) -> StageSweep:
        """The entry of a sweepable stage; ConfigError naming the valid ones otherwise."""
        if name not in OBJECTIVES:
            raise ConfigError(
                f"stage {name!r} has no sweep objective; sweepable stages: {', '.join(OBJECTIVES)} "
                "(ops/sweep/targets.py: OBJECTIVES maps a stage to what its trials train and report)"
            )
        return getattr(self, name)

    def ranges(self, stage: str) -> dict[str, ParamRange]:
        """``sweep.<stage>.space`` as checked ``ParamRange``s (ConfigError naming the key otherwise)."""
        return _check_stage(stage, self.stage(stage), OBJECTIVES[stage])


def _check_stage(stage: str, entry: StageSweep, target: SweepTarget) -> dict[str, ParamRange]:
    where = f"sweep.{stage}"
    if entry.metric not in target.metrics:
        raise ConfigError(f"params key '{where}.metric': {entry.metric!r} is not reported by {stage}; "
                          f"use one of {list(target.metrics)}")
    if entry.direction not in DIRECTIONS:
        raise ConfigError(f"params key '{where}.direction': {entry.direction!r} is not one of {list(DIRECTIONS)}")
    if entry.trials < 1:
        raise ConfigError(f"params key '{where}.trials' = {entry.trials} must be ≥ 1")
    for key, value in entry.fixed.items():
        hint = _field_hint(target, stage, str(key), f"{where}.fixed.{key}")
        _check_type(value, hint, f"{where}.fixed.{key}")
    ranges: dict[str, ParamRange] = {}
    for key, raw in entry.space.items():
        p = f"{where}.space.{key}"
        if not isinstance(key, str):
            raise ConfigError(f"params key '{p}': space keys are dotted params keys such as {target.section}.lr")
        if key in entry.fixed:
            raise ConfigError(f"params key '{p}': {key} is also in {where}.fixed; a key is either searched or fixed")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"params key '{p}': expected a mapping such as "
                              "{type: float, low: 0.0001, high: 0.01, log: true}, got " + repr(raw))
        hint = _field_hint(target, stage, key, p)
        ranges[key] = from_mapping(ParamRange, raw, p)
        _check_range(p, key, ranges[key], hint)
    return ranges


def _field_hint(target: SweepTarget, stage: str, key: str, where: str) -> Any:
    """The type annotation of the params key ``key`` (``fr.lr``, ``fr.augmentation.flip``) in the stage's config
    class; ConfigError naming ``where`` when it is not one."""
    parts = key.split(".")
    if parts[0] != target.section or len(parts) < 2:
        raise ConfigError(f"params key '{where}': {key!r} is not a key of the {target.section} section; {stage} "
                          f"trials may change `{target.section}.*` keys only, e.g. {target.section}.lr")
    cls = target.config_class()
    hint: Any = cls
    for depth, part in enumerate(parts[1:], start=1):
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(f"params key '{where}': {'.'.join(parts[:depth])} is a value, not a section")
        names = [f.name for f in dataclasses.fields(hint)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            did = f" Did you mean '{'.'.join(parts[:depth] + close)}'?" if close else ""
            raise ConfigError(f"params key '{where}': {key!r} is not a params key of stage {stage}.{did} "
                              f"Keys of {'.'.join(parts[:depth])}: {', '.join(sorted(names))}.")
        hint = typing.get_type_hints(hint)[part]
    return hint


def _leaf_kind(hint: Any) -> str:
    """``float``, ``int``, ``scalar`` (str, bool, Literal) or ``other`` (lists, mappings, sections)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _leaf_kind(args[0]) if len(args) == 1 else "other"
    if origin is typing.Literal or hint in (str, bool):
        return "scalar"
    if hint is float:
        return "float"
    if hint is int:
        return "int"
    return "other"


def _check_range(p: str, key: str, r: ParamRange, hint: Any) -> None:
    """The range ``r`` at params key ``p`` is a valid Optuna distribution for a field annotated ``hint``."""
    kind = _leaf_kind(hint)
    if r.type not in KINDS:
        raise ConfigError(f"params key '{p}.type': {r.type!r} is not one of {list(KINDS)}")
    if kind == "other":
        raise ConfigError(f"params key '{p}': {key} is not a number, string or boolean; Optuna searches scalars only")
    if r.type == "categorical":
        for name in ("low", "high", "step"):
            if getattr(r, name) is not None:
                raise ConfigError(f"params key '{p}.{name}': not used by type categorical (list the values in choices)")
        if r.log:
            raise ConfigError(f"params key '{p}.log': not used by type categorical")
        if not r.choices:
            raise ConfigError(f"params key '{p}.choices': a categorical range needs at least one value")
        for i, choice in enumerate(r.choices):
            if choice is not None and not isinstance(choice, (bool, int, float, str)):
                raise ConfigError(f"params key '{p}.choices[{i}]': Optuna samples numbers, strings, booleans or "
                                  f"null, got {choice!r}")
            _check_type(choice, hint, f"{p}.choices[{i}]")
            if choice in r.choices[:i]:
                raise ConfigError(f"params key '{p}.choices[{i}]': {choice!r} is listed twice")
        return
    if kind == "scalar" or (r.type == "float" and kind == "int"):
        need = "int or categorical" if kind == "int" else "categorical"
        raise ConfigError(f"params key '{p}.type': {key} is {getattr(hint, '__name__', hint)}; use type {need}")
    if r.choices is not None:
        raise ConfigError(f"params key '{p}.choices': only for type categorical (a {r.type} range has low and high)")
    for name in ("low", "high"):
        if getattr(r, name) is None:
            raise ConfigError(f"params key '{p}.{name}': required for type {r.type}")
    if r.type == "int":
        for name in ("low", "high", "step"):
            value = getattr(r, name)
            if value is not None and not float(value).is_integer():
                raise ConfigError(f"params key '{p}.{name}': type int needs whole numbers, got {value}")
    if r.low >= r.high:
        raise ConfigError(f"params key '{p}.low': {r.low} must be below {p}.high = {r.high}")
    if r.log and r.low <= 0:
        raise ConfigError(f"params key '{p}.low': a log-scale range needs low > 0, got {r.low}")
    if r.step is not None:
        if r.step <= 0:
            raise ConfigError(f"params key '{p}.step': must be > 0, got {r.step}")
        if r.log:
            raise ConfigError(f"params key '{p}.step': cannot be combined with log: true; drop one of them")


def check_space(stage: str, entry: StageSweep, ranges: Mapping[str, ParamRange], params: Mapping[str, Any]) -> None:
    """Every bound and choice is a value the stage accepts with the current params: ConfigError naming
    ``sweep.<stage>.space.<key>.<low|high|choices[i]>`` otherwise (before any trial runs)."""
    target = OBJECTIVES[stage]
    base = section(params, target.section)
    try:
        build_config(target, base, entry.fixed)
    except ConfigError as exc:
        raise ConfigError(f"params key 'sweep.{stage}.fixed': the stage rejects these values: {exc}") from None
    for key, r in ranges.items():
        probes = ([(f"choices[{i}]", c) for i, c in enumerate(r.choices or [])] if r.type == "categorical"
                  else [("low", _number(r, r.low)), ("high", _number(r, r.high))])
        for name, value in probes:
            try:
                build_config(target, base, {**entry.fixed, key: value})
            except ConfigError as exc:
                raise ConfigError(f"params key 'sweep.{stage}.space.{key}.{name}': {key} = {value!r} is rejected "
                                  f"by the stage: {exc}") from None


def _number(r: ParamRange, value: float | None) -> float | int | None:
    return int(value) if r.type == "int" and value is not None else value


def build_config(target: SweepTarget, base: Mapping[str, Any], delta: Mapping[str, Any]) -> Any:
    """The stage's config from its params section ``base`` with dotted ``delta`` keys (``fr.lr``) set, in memory."""
    merged = copy.deepcopy(dict(base))
    for key, value in delta.items():
        node = merged
        parts = key.split(".")[1:]
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, Mapping) else {}
            node = node[part]
        node[parts[-1]] = value
    return from_mapping(target.config_class(), merged, target.section)


# ── storage ───────────────────────────────────────────────────────────────────────────────────────────────────


def check_storage_text(value: str, where: str, *, allow_password: bool) -> None:
    """``value`` is a storage this module can open; a password is refused where it would be stored (params)."""
    if value == "" or (value.startswith("journal:") and value[len("journal:"):].strip()):
        return
    if not URL_SCHEMES.match(value):
        raise ConfigError(
            f"{where} = {redact(value)!r}: expected '' (sqlite:///optuna.db in the repository), journal:<file> "
            "(an Optuna journal file shared by processes), sqlite:///<file>, or postgresql://user@host:5432/db"
        )
    if not allow_password and urllib.parse.urlsplit(value).password:
        raise ConfigError(
            f"{where} = {redact(value)!r} carries a password; keep credentials out of params.yaml: drop it from "
            f"the URL and set PGPASSWORD (or ~/.pgpass), or pass the URL with --storage or ${ENV_STORAGE}"
        )


@dataclass(frozen=True)
class StorageSpec:
    """A resolved Optuna storage: ``kind`` ``journal`` (``target`` = absolute file) or ``rdb`` (``target`` = URL)."""

    kind: str
    target: str

    @property
    def text(self) -> str:
        """The form ``--storage`` and ``$FACEOPS_SWEEP_STORAGE`` accept (with any password: keep it in memory)."""
        return f"journal:{self.target}" if self.kind == "journal" else self.target

    @property
    def masked(self) -> str:
        return redact(self.text)


def resolve_storage(value: str, root: Path, where: str) -> StorageSpec:
    """``""`` → ``sqlite:///<root>/optuna.db``; ``journal:<file>`` relative to ``root``; URLs as they are."""
    check_storage_text(value, where, allow_password=True)
    if value == "":
        return StorageSpec("rdb", f"sqlite:///{(root / STORAGE_FILE).resolve()}")
    if value.startswith("journal:"):
        path = Path(value[len("journal:"):].strip()).expanduser()
        return StorageSpec("journal", str((root / path).resolve()))
    return StorageSpec("rdb", value)


def check_driver(spec: StorageSpec) -> None:
    """A database URL's driver is installed (checked before anything starts; SQLite's always is)."""
    if spec.kind != "rdb" or spec.target.startswith("sqlite"):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(spec.target).get_dialect().import_dbapi()
    except ArgumentError as exc:
        raise ConfigError(f"Optuna storage {spec.masked} is not a database URL SQLAlchemy understands: {exc}") from None
    except ImportError as exc:
        module = (exc.name or "").split(".")[0]
        package = DRIVER_PACKAGES.get(module, module or "the driver")
        raise SweepError(f"Optuna storage {spec.masked} needs the database driver {module or '(unknown)'}, which is "
                         f"not installed here: pip install '{package}' (or name an installed driver in the URL, e.g. "
                         "postgresql+pg8000://)") from None


def open_storage(spec: StorageSpec, heartbeat_s: int = 0) -> Any:
    """The Optuna storage object; SweepError with the masked location when it cannot be opened. With
    ``heartbeat_s`` > 0 an SQL storage records a heartbeat per running trial; one silent for three intervals is
    failed and retried once with the same params (see the module docstring)."""
    import optuna

    if spec.kind == "journal":
        path = Path(spec.target)
        if not path.parent.is_dir():
            raise SweepError(f"Optuna journal {path}: directory {path.parent} does not exist; create it (on a file "
                             "system every worker can reach) or pick another --storage")
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(path)))
    if spec.target.startswith("sqlite:///"):
        db = Path(spec.target[len("sqlite:///"):])
        if not db.parent.is_dir():
            raise SweepError(f"Optuna storage {spec.masked}: directory {db.parent} does not exist")
    engine = {"connect_args": {"timeout": 60}} if spec.target.startswith("sqlite") else {"pool_pre_ping": True}
    last: Exception | None = None
    for attempt in range(3):
        try:
            if heartbeat_s <= 0:
                return optuna.storages.RDBStorage(spec.target, engine_kwargs=engine)
            with warnings.catch_warnings():  # heartbeats have been "experimental" since Optuna 2.8: not news
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    spec.target, engine_kwargs=engine, heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except ImportError:  # check_driver names the module; here Optuna has wrapped the error
            check_driver(spec)
            raise SweepError(f"Optuna storage {spec.masked}: its database driver cannot be imported") from None
        except Exception as exc:  # sqlalchemy's OperationalError & co: unreachable host, bad credentials
            last = exc
            # processes creating a fresh database's tables at once race on them, on SQLite as on a server (two
            # CREATE TABLE alembic_version: "duplicate key value"); the loser finds them made on its next try
            raced = "duplicate key" in str(exc) or "already exists" in str(exc)
            if not (spec.target.startswith("sqlite") or raced):
                break
            time.sleep(1.0 + attempt)
    detail = redact(str(last).splitlines()[0] if str(last) else type(last).__name__)
    password = urllib.parse.urlsplit(spec.target).password
    if password:
        detail = detail.replace(password, "***")
    raise SweepError(f"cannot open Optuna storage {spec.masked}: {detail}. Check that it is reachable, or use "
                     "journal:<file> / the default SQLite file") from None
