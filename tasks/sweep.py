"""Optuna hyperparameter sweeps over one stage's params: ``faceops sweep train_fr`` (flow ``sweep``).

The search space is data: ``params.yaml``'s ``sweep:`` section (``SweepConfig``) holds the study settings
(storage, sampler, pruner, seed) and one entry per sweepable stage (``StageSweep``: metric, direction, trials,
``fixed`` overrides and ``space``, a mapping of dotted params keys such as ``fr.lr`` to ranges, ``ParamRange``).
Every range is checked against the stage's config class before a trial starts: a key that is not a params
key, a wrong type, ``low ≥ high``, a log scale reaching 0, no choices, or a bound the stage itself rejects
raises a ConfigError naming ``sweep.<stage>.space.<key>.<field>``.

A trial applies its values as an in-memory delta on the stage's section (``params.yaml`` is never written
during a sweep), trains, reports the stage's metric after every epoch to Optuna, which may prune it (Optuna's
Lightning pruning callback), and returns the last value. ``OBJECTIVES`` maps each sweepable stage to what that
means (``SweepTarget``); ``train_fr`` reports ``val/accuracy``, the closed-set identification accuracy of the
prepared set's ``val`` split against the margin head's class centres.

One study, many processes: every command or worker with the same storage and study name joins the same study
(the storage hands out trial numbers, so none is lost or run twice). The process that creates the study also
creates the MLflow parent run and records its id in the study; the others wait for that id, so all trials,
whatever process ran them, are nested runs under one parent, each with its params, per-epoch curves, its state
(``optuna.trial_state``: COMPLETE, PRUNED, FAIL) and its number. Storage: ``""`` is ``sqlite:///optuna.db`` in
the repository, ``journal:<file>`` an Optuna JournalStorage file (several processes on one machine or a shared
file system), or an SQLAlchemy URL (``postgresql://user@host/db``; the password comes from ``PGPASSWORD`` or
``~/.pgpass``, never from params.yaml; printed and logged URLs have it masked).

A worker killed mid-trial (SIGKILL, a lost node) cannot mark its trial finished. On an SQL storage every running
trial beats a heartbeat every ``sweep.heartbeat_s`` seconds; a trial silent for three intervals is marked FAIL
by the next worker that starts a trial, and run again once with the same params (Optuna's
``RetryFailedTrialCallback``: the copy records the failed trial's number). A JournalStorage has no heartbeat in
Optuna: there such a trial stays RUNNING, so use an SQL storage for workers that may be killed.

After the trials, ``report`` writes the optimisation history and parameter importance plots
(``plots/sweeps/``), the best params and value (``reports/sweeps/<study>.json``) and logs them to the parent
run; ``apply_best`` writes the best params into ``params.yaml`` (comments kept) and returns a unified diff.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import hashlib
import importlib
import json
import logging
import os
import re
import secrets
import socket
import time
import types
import typing
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ml.config import _check_type, from_mapping, to_flat_dict
from ml.errors import ConfigError, DataError, FaceopsError, TrainingError
from tasks.common import Paths, load_params, section, stage_main, write_json
from tasks.common import redact as mask_url  # user:***@ in storage and tracking URLs (faceops.cli imports it)

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
KINDS = ("float", "int", "categorical")
DIRECTIONS = ("maximize", "minimize")
ENV_STORAGE = "FACEOPS_SWEEP_STORAGE"  # a storage URL from the environment (e.g. a secret), between --storage and params
STORAGE_FILE = "optuna.db"
PARENT_ATTR = "mlflow_parent_run_id"  # study user attr: the MLflow run every trial nests under
PARENT_WAIT_S = 120.0  # how long a joining process waits for the creator to record the parent run
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
    train_fr: StageSweep = field(default_factory=StageSweep)

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
                "(tasks/sweep.py: OBJECTIVES maps a stage to what its trials train and report)"
            )
        return getattr(self, name)

    def ranges(self, stage: str) -> dict[str, ParamRange]:
        """``sweep.<stage>.space`` as checked ``ParamRange``s (ConfigError naming the key otherwise)."""
        return _check_stage(stage, self.stage(stage), OBJECTIVES[stage])


def _check_stage(stage: str, entry: StageSweep, target: "SweepTarget") -> dict[str, ParamRange]:
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


def _field_hint(target: "SweepTarget", stage: str, key: str, where: str) -> Any:
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


def build_config(target: "SweepTarget", base: Mapping[str, Any], delta: Mapping[str, Any]) -> Any:
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
            f"{where} = {mask_url(value)!r}: expected '' (sqlite:///optuna.db in the repository), journal:<file> "
            "(an Optuna journal file shared by processes), sqlite:///<file>, or postgresql://user@host:5432/db"
        )
    if not allow_password and urllib.parse.urlsplit(value).password:
        raise ConfigError(
            f"{where} = {mask_url(value)!r} carries a password; keep credentials out of params.yaml: drop it from "
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
        return mask_url(self.text)


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
    for attempt in range(3):  # processes creating one fresh SQLite file at once race on its tables: retry
        try:
            if heartbeat_s <= 0:
                return optuna.storages.RDBStorage(spec.target, engine_kwargs=engine)
            return optuna.storages.RDBStorage(
                spec.target, engine_kwargs=engine, heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
                failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=1))
        except ImportError:  # check_driver names the module; here Optuna has wrapped the error
            check_driver(spec)
            raise SweepError(f"Optuna storage {spec.masked}: its database driver cannot be imported") from None
        except Exception as exc:  # sqlalchemy's OperationalError & co: unreachable host, bad credentials
            last = exc
            if not spec.target.startswith("sqlite"):
                break
            time.sleep(1.0 + attempt)
    detail = mask_url(str(last).splitlines()[0] if str(last) else type(last).__name__)
    password = urllib.parse.urlsplit(spec.target).password
    if password:
        detail = detail.replace(password, "***")
    raise SweepError(f"cannot open Optuna storage {spec.masked}: {detail}. Check that it is reachable, or use "
                     "journal:<file> / the default SQLite file") from None


# ── tracking ──────────────────────────────────────────────────────────────────────────────────────────────────


def ensure_tracking(root: Path) -> str:
    """Check the MLflow store answers and set the experiment (created once, before any worker starts trials);
    → experiment id. SweepError, with nothing written, when the tracking endpoint is unreachable."""
    from tasks.tracking import configure, tracking_uri

    uri = tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(uri)  # without user:password@, which urllib does not take in a URL
        probe = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl().rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(probe, timeout=5):
                pass
        except urllib.error.HTTPError:
            pass  # it answered; MLflow itself reports auth or path problems below
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SweepError(f"MLflow tracking server {mask_url(uri)} is unreachable ({reason}); start it or point "
                             "MLFLOW_TRACKING_URI at a running one (unset: mlflow.db in the repository). Nothing "
                             "was run or written.") from None
    elif uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).parent.is_dir():
        raise SweepError(f"MLflow store {uri}: its directory does not exist")
    last: Exception | None = None
    for attempt in range(3):  # two processes creating a fresh SQLite store or the experiment at once: retry
        try:
            return configure(root)
        except Exception as exc:
            last = exc
            if not uri.startswith("sqlite"):
                break
            time.sleep(1.0 + attempt)
    raise SweepError(f"MLflow at {mask_url(uri)} refused the experiment: {mask_url(str(last).splitlines()[0])}") from None


def _client(root: Path) -> Any:
    from mlflow import MlflowClient

    from tasks.tracking import tracking_uri

    return MlflowClient(tracking_uri(root))


# ── what a sweep of each stage trains and reports ─────────────────────────────────────────────────────────────


TrialTrainer = Callable[[Any, Any, Any], float]  # (stage config, optuna trial, tracker) → the trial's value


@dataclass(frozen=True)
class SweepTarget:
    """What sweeping one stage means: the params section its trials change, that section's config class
    (``module:Class``), the metrics a trial reports each epoch, a cheap check that its data exist, and a factory
    that loads the data once per process and returns the function training one trial."""

    section: str
    config: str
    metrics: tuple[str, ...]
    check_data: Callable[[Paths, Mapping[str, Any], str], None]
    trainer: Callable[[Paths, Mapping[str, Any], str], TrialTrainer]

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)


def _fr_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> None:
    """The prepared training set exists, with a ``val`` split when the metric is measured on it."""
    from ml.data.dataset import read_manifest

    manifest_path = paths.train_set / "manifest.parquet"
    if not manifest_path.is_file():
        raise DataError(f"{paths.train_set} holds no prepared dataset: run `dvc repro prepare` "
                        "(or `faceops run --stage prepare`) before sweeping train_fr")
    splits = set(read_manifest(manifest_path)["split"])
    if "train" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'train' to train on")
    if metric.startswith("val/") and "val" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'val' to measure {metric}; set data.val_fraction > 0 "
                        "and rerun prepare, or sweep on sweep.train_fr.metric train/loss")


def _fr_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """Load the prepared set's train and val splits once; → a function that trains one FR trial on them."""
    import numpy as np

    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.train.fr import train
    from tasks.common import core_share_callbacks
    from tasks.prepare import DataConfig
    from tasks.tracking import lightning_logger

    data = from_mapping(DataConfig, section(params, "data"), "data")
    manifest = read_manifest(paths.train_set / "manifest.parquet")
    size = (data.image_size, data.image_size)
    rows = {s: manifest[manifest["split"] == s].reset_index(drop=True) for s in ("train", "val")}
    images = load_images(paths.train_set, rows["train"], expected_size=size)
    labels = rows["train"]["label"].to_numpy()
    keypoints = landmarks_array(rows["train"])  # used by KP-RPE backbones only
    val = None
    if len(rows["val"]):
        val = (load_images(paths.train_set, rows["val"], expected_size=size), rows["val"]["label"].to_numpy(),
               landmarks_array(rows["val"]))
    log.info("train_fr trials: %d training images of %d identities, %d val images", len(labels),
             int(np.max(labels)) + 1, 0 if val is None else len(val[1]))

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        if cfg.devices * cfg.num_nodes != 1:
            raise ConfigError(f"sweep trials train on one device (fr.devices = {cfg.devices}, fr.num_nodes = "
                              f"{cfg.num_nodes}); scale a sweep out with more workers on one study instead")
        pruning = _fr_pruning(trial, metric)
        train(cfg, images, labels, loggers=[lightning_logger(tracker)], keypoints=keypoints, progress=False,
              callbacks=[pruning, *core_share_callbacks()], val=val)
        values = pruning.values
        if not values:
            raise TrainingError(f"the trial reported no {metric}: training ran no epoch")
        return values[-1]

    return train_trial


def _fr_pruning(trial: Any, metric: str) -> Any:
    """Optuna's pruning callback on ``metric`` after every epoch; ``values`` keeps what it saw. ``val/accuracy`` is
    the FR trainer's own (``ml.train.fr.train(..., val=...)``), measured before the callbacks run."""
    import optuna
    from optuna_integration import PyTorchLightningPruningCallback

    class EpochPruning(PyTorchLightningPruningCallback):
        """Optuna's Lightning pruning callback, reporting ``monitor`` after every training epoch (the FR trainer
        has no validation loop). Raises ``optuna.TrialPruned`` to stop."""

        def __init__(self) -> None:
            super().__init__(trial, monitor=metric)
            self.values: list[float] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                raise TrainingError(f"metric {self.monitor} was not reported this epoch (reported: "
                                    f"{sorted(trainer.callback_metrics)}); check sweep.train_fr.metric")
            self.values.append(float(value))
            try:
                self.on_validation_end(trainer, pl_module)
            except optuna.TrialPruned:
                # Lightning logs an epoch's metrics after its epoch-end hooks, which this stops: log the one the
                # trial was pruned on now
                for logger in trainer.loggers:
                    logger.log_metrics({self.monitor: float(value)}, step=trainer.global_step - 1)
                raise

    return EpochPruning()


OBJECTIVES: dict[str, SweepTarget] = {
    "train_fr": SweepTarget(
        section="fr", config="ml.train.fr_config:FRConfig", metrics=("val/accuracy", "train/accuracy", "train/loss"),
        check_data=_fr_check_data, trainer=_fr_trainer,
    ),
}


# ── one study, many processes ─────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class SweepPlan:
    """Everything a process needs to run trials of one study: where, what, and the MLflow parent run."""

    stage: str
    study: str
    storage: StorageSpec
    root: Path
    trials: int
    seed: int
    created: bool  # this process created the study (and its parent run)
    experiment_id: str
    parent_run_id: str


def default_study_name(stage: str, entry: StageSweep, settings: SweepConfig, params: Mapping[str, Any]) -> str:
    """``<stage>-<8 hex>`` from the space, fixed values, metric and the stage's other params: rerunning the same
    command continues the study, changing the space starts a new one (``--apply`` keeps it)."""
    target = OBJECTIVES[stage]
    base = {k: v for k, v in dict(section(params, target.section)).items()
            if f"{target.section}.{k}" not in entry.space}
    blob = json.dumps({"entry": dataclasses.asdict(entry), "base": base, "sampler": settings.sampler,
                       "pruner": settings.pruner}, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def check_request(stage: str, *, trials: int | None = None, storage: str | None = None, root: Path | str = ".",
                  workers: int = 1) -> tuple[SweepConfig, StageSweep, StorageSpec]:
    """Everything that can be checked without opening a study: params, space against the stage's config, the
    storage's form, the stage's data and the tracking endpoint. Raises a FaceopsError naming what to fix."""
    root = Path(root).resolve()
    params = load_params(root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    entry = settings.stage(stage)
    ranges = settings.ranges(stage)
    if not ranges:
        raise ConfigError(f"params key 'sweep.{stage}.space' is empty: add the params keys to search, e.g. "
                          f"{OBJECTIVES[stage].section}.lr: {{type: float, low: 0.0001, high: 0.01, log: true}}")
    if trials is not None and trials < 0:
        raise ConfigError(f"--trials {trials}: must be ≥ 0 (0 = only report on, or --apply, an existing study)")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be ≥ 1")
    check_space(stage, entry, ranges, params)
    spec = _storage_spec(storage, settings, root)
    check_driver(spec)
    OBJECTIVES[stage].check_data(Paths(root), params, entry.metric)
    from tasks.tracking import tracking_uri

    uri = tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        ensure_tracking(root)
    return settings, entry, spec


def _storage_spec(storage: str | None, settings: SweepConfig, root: Path) -> StorageSpec:
    if storage:
        return resolve_storage(storage, root, "--storage")
    if os.environ.get(ENV_STORAGE):
        return resolve_storage(os.environ[ENV_STORAGE], root, f"${ENV_STORAGE}")
    return resolve_storage(settings.storage, root, "sweep.storage")


def prepare_sweep(stage: str, *, trials: int | None = None, storage: str | None = None, study: str | None = None,
                  root: Path | str = ".", seed: int | None = None, tags: Mapping[str, str] | None = None) -> SweepPlan:
    """Check the request, reach MLflow, create or join the study and its MLflow parent run; → the plan.

    The first process to create study ``study`` (storage creation is atomic) opens the parent run and records
    it in the study; processes joining wait for it. Nothing is created when a check fails. ``seed``: the
    sampler's seed in this process (default: ``sweep.seed`` for the creator, random for a joiner, so that
    workers do not repeat each other's suggestions)."""
    import optuna

    root = Path(root).resolve()
    settings, entry, spec = check_request(stage, trials=trials, storage=storage, root=root)
    params = load_params(root / "params.yaml")
    name = study or default_study_name(stage, entry, settings, params)
    experiment_id = ensure_tracking(root)
    backend = open_storage(spec)
    if trials == 0 and name not in optuna.get_all_study_names(backend):
        raise ConfigError(f"--trials 0 reports on an existing study, but {spec.masked} has no study {name!r}; "
                          "name it with --study, or run some trials")
    try:
        handle = optuna.create_study(storage=backend, study_name=name, direction=entry.direction)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        handle = optuna.load_study(study_name=name, storage=backend)
        created = False
    if created:
        _describe_study(handle, stage, entry, settings)
        parent = _create_parent_run(root, experiment_id, handle, stage, entry, settings, spec, tags or {})
    else:
        _check_joined_study(handle, name, stage, entry, spec)
        parent = _join_parent_run(root, handle, name, spec, reopen=trials != 0)
    if seed is None:
        seed = settings.seed if created else secrets.randbits(31)
    log.info("%s study %r in %s (MLflow parent run %s), sampler seed %d", "created" if created else "joined",
             name, spec.masked, parent, seed)
    return SweepPlan(stage, name, spec, root, entry.trials if trials is None else trials, seed, created,
                     experiment_id, parent)


def _describe_study(study: Any, stage: str, entry: StageSweep, settings: SweepConfig) -> None:
    study.set_user_attr("faceops.stage", stage)
    study.set_user_attr("faceops.metric", entry.metric)
    study.set_user_attr("faceops.space", json.loads(json.dumps(entry.space, default=str)))
    study.set_user_attr("faceops.fixed", json.loads(json.dumps(entry.fixed, default=str)))


def _check_joined_study(study: Any, name: str, stage: str, entry: StageSweep, spec: StorageSpec) -> None:
    attrs = study.user_attrs
    other = attrs.get("faceops.stage", stage)
    if other != stage:
        raise ConfigError(f"study {name!r} in {spec.masked} sweeps stage {other!r}, not {stage!r}; pick another --study")
    if attrs.get("faceops.metric", entry.metric) != entry.metric:
        raise ConfigError(f"study {name!r} optimises {attrs['faceops.metric']!r} but sweep.{stage}.metric is "
                          f"{entry.metric!r}; pick another --study or set the metric back")
    direction = study.direction.name.lower()
    if direction != entry.direction:
        raise ConfigError(f"study {name!r} is to {direction} but sweep.{stage}.direction is {entry.direction!r}; "
                          "pick another --study")
    if attrs.get("faceops.space") not in (None, json.loads(json.dumps(entry.space, default=str))):
        log.warning("study %r was started with another search space (%s); its new trials use params.yaml's",
                    name, attrs["faceops.space"])


def _create_parent_run(root: Path, experiment_id: str, study: Any, stage: str, entry: StageSweep,
                       settings: SweepConfig, spec: StorageSpec, tags: Mapping[str, str]) -> str:
    from tasks.tracking import git_commit

    client = _client(root)
    commit = git_commit(root)
    run = client.create_run(experiment_id, run_name=f"sweep-{study.study_name}", tags={
        "faceops.kind": "sweep", "faceops.stage": stage, "optuna.study": study.study_name,
        "optuna.storage": spec.masked, "git.commit": commit, **tags,
    })
    run_id = run.info.run_id
    sweep_params = {"sweep.metric": entry.metric, "sweep.direction": entry.direction, "sweep.sampler": settings.sampler,
                    "sweep.pruner": settings.pruner, "sweep.seed": settings.seed,
                    "sweep.startup_trials": settings.startup_trials, "sweep.warmup_epochs": settings.warmup_epochs,
                    "sweep.space": json.dumps(entry.space, default=str), "sweep.fixed": json.dumps(entry.fixed, default=str)}
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sweep_params.items()])
    study.set_user_attr(PARENT_ATTR, run_id)
    return run_id


def _join_parent_run(root: Path, study: Any, name: str, spec: StorageSpec, *, reopen: bool = True) -> str:
    """The parent run recorded by the study's creator (waiting for it a little); with ``reopen``, set RUNNING
    again if a finished sweep is being continued (``report`` closes it)."""
    deadline = time.monotonic() + PARENT_WAIT_S
    run_id = study.user_attrs.get(PARENT_ATTR)
    while run_id is None and time.monotonic() < deadline:
        time.sleep(0.5)
        run_id = study.user_attrs.get(PARENT_ATTR)
    if run_id is None:
        raise SweepError(f"study {name!r} in {spec.masked} records no MLflow parent run after {PARENT_WAIT_S:.0f} s; "
                         "the process that created it may have failed: start a new study (--study)")
    from tasks.tracking import tracking_uri

    client = _client(root)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise SweepError(f"study {name!r} nests its trials under MLflow run {run_id}, which is not in "
                         f"{mask_url(tracking_uri(root))}: point MLFLOW_TRACKING_URI at the store the study "
                         "started with, or start a new study (--study)") from None
    if reopen and run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    return run_id


# ── trials ────────────────────────────────────────────────────────────────────────────────────────────────────


def make_sampler(settings: SweepConfig, seed: int) -> Any:
    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant liar (Optuna 5's default): running trials of other workers count as bad, so they are not repeated
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=settings.startup_trials)


def make_pruner(settings: SweepConfig) -> Any:
    import optuna

    if settings.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=settings.startup_trials, n_warmup_steps=settings.warmup_epochs)


def suggest(trial: Any, key: str, r: ParamRange) -> Any:
    """The trial's value for params key ``key`` from its range."""
    if r.type == "categorical":
        return trial.suggest_categorical(key, list(r.choices or []))
    if r.type == "int":
        return trial.suggest_int(key, int(r.low), int(r.high), step=int(r.step or 1), log=r.log)
    return trial.suggest_float(key, float(r.low), float(r.high), step=r.step, log=r.log)


def run_trials(plan: SweepPlan, trials: int | None = None, *, pruner: Any = None, threads: int | None = None) -> int:
    """Run ``trials`` (default: the plan's) trials of the plan's study in this process; → how many ran.

    A trial whose config the stage rejects or whose training fails (NaN loss) is recorded FAIL and the study
    goes on; any other error stops the sweep. ``pruner`` replaces ``sweep.pruner`` (tests force pruning)."""
    import optuna

    n = plan.trials if trials is None else trials
    if n == 0:
        return 0
    params = load_params(plan.root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    entry = settings.stage(plan.stage)
    if threads:
        import torch

        torch.set_num_threads(threads)
    ensure_tracking(plan.root)  # this process's MLflow client points at the store
    target = OBJECTIVES[plan.stage]
    train_trial = target.trainer(Paths(plan.root), params, entry.metric)
    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage, settings.heartbeat_s),
                              sampler=make_sampler(settings, plan.seed), pruner=pruner or make_pruner(settings))
    objective = _objective(plan, target, settings.ranges(plan.stage), entry, params, train_trial)
    study.optimize(objective, n_trials=n, catch=(FaceopsError,), gc_after_trial=True)
    return n


def _objective(plan: SweepPlan, target: SweepTarget, ranges: Mapping[str, ParamRange], entry: StageSweep,
               params: Mapping[str, Any], train_trial: TrialTrainer) -> Callable[[Any], float]:
    import mlflow
    import optuna

    from tasks.tracking import StageTracker, git_commit

    base = section(params, target.section)
    commit = git_commit(plan.root)

    def objective(trial: Any) -> float:
        values = {key: suggest(trial, key, r) for key, r in ranges.items()}
        run = mlflow.start_run(experiment_id=plan.experiment_id, run_name=f"trial-{trial.number}",
                               parent_run_id=plan.parent_run_id, tags={
                                   "faceops.kind": "sweep-trial", "faceops.stage": plan.stage,
                                   "optuna.study": plan.study, "optuna.trial_number": str(trial.number),
                                   "optuna.worker": f"{socket.gethostname()}:{os.getpid()}", "git.commit": commit,
                               })
        try:
            trial.set_user_attr("mlflow_run_id", run.info.run_id)
            mlflow.log_params({k: str(v) for k, v in values.items()})
            cfg = build_config(target, base, {**entry.fixed, **values})
            rest = to_flat_dict(cfg, f"{target.section}.")
            mlflow.log_params({k: str(v)[:500] for k, v in rest.items() if k not in values})
            value = float(train_trial(cfg, trial, StageTracker(run.info.run_id, plan.root)))
        except optuna.TrialPruned:
            _end_trial_run("PRUNED", "FINISHED")
            raise
        except KeyboardInterrupt:
            _end_trial_run("FAIL", "KILLED", "interrupted")
            raise
        except BaseException as exc:
            _end_trial_run("FAIL", "FAILED", str(exc))
            raise
        if value != value:  # NaN: Optuna would record the trial FAIL; say why
            _end_trial_run("FAIL", "FAILED", f"{entry.metric} is NaN")
            raise TrainingError(f"trial {trial.number}: {entry.metric} is NaN")
        mlflow.log_metric("sweep/value", value)
        _end_trial_run("COMPLETE", "FINISHED")
        return value

    return objective


def _end_trial_run(state: str, status: str, reason: str = "") -> None:
    import mlflow

    tags = {"optuna.trial_state": state}
    if reason:
        tags["optuna.fail_reason"] = mask_url(reason)[:500]
    mlflow.set_tags(tags)
    mlflow.end_run(status)


# ── after the trials ──────────────────────────────────────────────────────────────────────────────────────────


def _stem(study: str) -> str:
    return re.sub(r"[^\w.-]", "_", study)


def report_paths(root: Path, study: str) -> dict[str, Path]:
    """Where a study's summary goes: ``reports/sweeps/<study>.json``, ``plots/sweeps/<study>_{history,importance}.png``."""
    paths, stem = Paths(root), _stem(study)
    return {"summary": paths.root / "reports" / "sweeps" / f"{stem}.json",
            "history": paths.plots / "sweeps" / f"{stem}_history.png",
            "importance": paths.plots / "sweeps" / f"{stem}_importance.png"}


def report(plan: SweepPlan) -> dict[str, Any]:
    """Summarise the study as it stands: counts per state, the best trial, optimisation history and parameter
    importance plots; written under ``reports/sweeps`` and ``plots/sweeps`` and logged to the parent run, which
    is closed when no trial of the study is still running."""
    import optuna

    from tasks.tracking import mlflow_metric_name, tracking_uri

    params = load_params(plan.root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    metric = settings.stage(plan.stage).metric
    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))
    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): sum(t.state == s for t in trials) for s in optuna.trial.TrialState}
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": b.params, "mlflow_run_id": b.user_attrs.get("mlflow_run_id")}
    out = report_paths(plan.root, plan.study)
    notes: list[str] = []
    plots: dict[str, str] = {}
    importances: dict[str, float] = {}
    if complete:
        plots["history"] = str(_plot(optuna.visualization.matplotlib.plot_optimization_history, out["history"],
                                     study, target_name=metric))
    else:
        notes.append("no completed trial yet: optimisation history not plotted")
    if len(complete) >= 2:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=settings.seed)
        try:
            importances = dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
            plots["importance"] = str(_plot(optuna.visualization.matplotlib.plot_param_importances, out["importance"],
                                            study, evaluator=evaluator, target_name=metric))
        except (ValueError, RuntimeError) as exc:  # e.g. every completed trial has the same params
            notes.append(f"parameter importance not computed: {exc}")
    else:
        notes.append(f"parameter importance needs at least 2 completed trials; this study has {len(complete)}: "
                     "not plotted")
    idle = not counts.get("running") and not counts.get("waiting")
    if not idle:
        notes.append(f"{counts.get('running', 0)} trial(s) still running in other processes: the last process to "
                     "finish logs the plots and this summary to the parent run")
    summary = {
        "stage": plan.stage, "study": plan.study, "storage": plan.storage.masked, "metric": metric,
        "direction": study.direction.name.lower(), "trials": {**counts, "total": len(trials)}, "best": best,
        "importance": importances, "plots": plots, "notes": notes, "mlflow_parent_run_id": plan.parent_run_id,
        "mlflow_tracking_uri": mask_url(tracking_uri(plan.root)),
    }
    write_json(out["summary"], summary)
    summary["report"] = str(out["summary"])
    client = _client(plan.root)
    if idle:  # the last process to finish logs the files (two copying one artifact at once could garble it)
        for path in plots.values():
            client.log_artifact(plan.parent_run_id, path, "plots")
        client.log_artifact(plan.parent_run_id, str(out["summary"]), "reports")
    metrics = {f"sweep/trials_{k}": float(v) for k, v in counts.items() if k in ("complete", "pruned", "fail")}
    if best is not None:
        metrics["sweep/best_value"] = float(best["value"])
        client.set_tag(plan.parent_run_id, "sweep.best_trial", str(best["number"]))
        for key, value in best["params"].items():
            client.set_tag(plan.parent_run_id, f"sweep.best.{key}", str(value))
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(plan.parent_run_id, metrics=[Metric(mlflow_metric_name(k), v, now, 0) for k, v in metrics.items()])
    if idle:
        client.set_terminated(plan.parent_run_id, "FINISHED")
    for note in notes:
        log.info("%s: %s", plan.study, note)
    return summary


def _plot(fn: Callable[..., Any], path: Path, study: Any, **kwargs: Any) -> Path:
    import warnings

    from tasks.common import pyplot, save_figure

    pyplot()  # the file-only backend, before Optuna touches matplotlib
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        ax = fn(study, **kwargs)
    fig = ax.figure
    fig.set_size_inches(7.5, 4.2)
    fig.tight_layout()
    return save_figure(fig, path)


def apply_best(plan: SweepPlan) -> dict[str, Any]:
    """Write the study's best params into ``params.yaml`` (comments kept, via ``tasks.params.apply_delta``);
    → ``{"changes": {key: [old, new]}, "diff": unified diff of params.yaml}``. Keys already at their best value
    are left alone; ``fixed`` values are never written. SweepError when no trial completed."""
    import optuna

    from tasks.params import apply_delta

    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        raise SweepError(f"study {plan.study!r} has no completed trial: nothing to apply; run more trials "
                         f"(faceops sweep {plan.stage} --study {plan.study})")
    best = study.best_trial
    params_path = plan.root / "params.yaml"
    current = load_params(params_path)
    changed = {k: v for k, v in best.params.items() if _lookup(current, k) != v}
    if not changed:
        return {"trial": best.number, "value": best.value, "changes": {}, "diff": ""}
    before = params_path.read_text()
    changes = apply_delta(params_path, changed)
    after = params_path.read_text()
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        "a/params.yaml", "b/params.yaml"))
    _client(plan.root).log_text(plan.parent_run_id, diff, "reports/params.diff")
    log.info("params.yaml: wrote the best params of trial %d (%s = %s)", best.number, plan.study, best.value)
    return {"trial": best.number, "value": best.value, "changes": {k: [o, n] for k, (o, n) in changes.items()},
            "diff": diff}


def _lookup(params: Mapping[str, Any], key: str) -> Any:
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def run_sweep(stage: str = "train_fr", *, trials: int | None = None, storage: str | None = None,
              study: str | None = None, root: Path | str = ".", apply: bool = False, pruner: Any = None) -> dict[str, Any]:
    """The whole sweep in this process, without Prefect (the ``sweep`` flow runs the same steps as tasks)."""
    plan = prepare_sweep(stage, trials=trials, storage=storage, study=study, root=root)
    run_trials(plan, pruner=pruner)
    summary = report(plan)
    if apply:
        summary["applied"] = apply_best(plan)
    return summary


# ── a worker process ──────────────────────────────────────────────────────────────────────────────────────────


def worker_command(plan: SweepPlan, trials: int, seed: int) -> list[str]:
    """The command of one extra worker process on the plan's study (the storage travels in ``$FACEOPS_SWEEP_STORAGE``,
    not in the command line, where other users of the machine could read a password)."""
    import sys

    return [sys.executable, "-m", "tasks.sweep", plan.stage, "--study", plan.study, "--trials", str(trials),
            "--seed", str(seed)]


def main(argv: list[str] | None = None) -> None:
    """``python -m tasks.sweep STAGE --study NAME --trials N [--seed S]``: join a study and run N trials."""
    parser = argparse.ArgumentParser(prog="python -m tasks.sweep",
                                     description="One sweep worker: join study NAME and run N trials of STAGE.")
    parser.add_argument("stage")
    parser.add_argument("--study", required=True)
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    plan = prepare_sweep(args.stage, trials=args.trials, study=args.study, root=Path.cwd(), seed=args.seed)
    run_trials(plan)


if __name__ == "__main__":
    stage_main(main)
