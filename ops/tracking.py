"""MLflow for stage executions: one run per execution, nested under the Prefect flow's run.

Every stage run carries its params section, metrics, plots, dataset inputs with content digests, and
the tags ``git.commit``, ``dvc.stage``, ``faceops.invocation`` and (when Prefect drives it)
``prefect.flow_run_id``. The flow adds DVC's dependency hashes after the stage ends (it reads
``dvc.lock``, which DVC writes only then).

Two ways to reach MLflow, chosen by ``stage_run``:

- **direct** (``dvc repro``, ``faceops stage``): the stage process opens its own MLflow run.
- **journal** (``faceops run``): the flow's task sets ``FACEOPS_TRACKING_JOURNAL``; the stage process writes
  each tracking call as one JSON line there and never imports MLflow (importing it and opening the SQLite
  store costs 3–4 s per process), while a ``StageRelay`` thread in the flow process, where MLflow is already
  loaded, replays the lines into MLflow as they arrive — curves show up live, and logging overlaps the
  stage's work instead of adding to it. If MLflow fails, the journal is kept, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ops.run_config import ENV_MOVE_ALIASES, alias_policy, promotable, run_config  # the registry rule
from ops.run_store import configure, store_creation_lock, tracking_uri  # where the project's store is

ENV_PARENT_RUN = "FACEOPS_PARENT_RUN_ID"
ENV_FLOW_RUN = "FACEOPS_PREFECT_FLOW_RUN_ID"
ENV_INVOCATION = "FACEOPS_INVOCATION_ID"
ENV_JOURNAL = "FACEOPS_TRACKING_JOURNAL"

log = logging.getLogger(__name__)

# relays of stages running side by side share one MLflow store: one write at a time from this process
MLFLOW_LOCK = threading.RLock()


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def mlflow_metric_name(name: str) -> str:
    """MLflow accepts ``[\\w./\\- :]`` only: ``test/tar@far=1e-4`` → ``test/tar_at_far_1e-4``."""
    return re.sub(r"[^\w./\- :]", "_", name.replace("@", "_at_"))


# MLflow's runs table has a column for every metric key of every run in the experiment. A column holds a number runs
# are compared on; what qualifies one (counts, confidence bounds, spreads) and a gate's per-check tallies go to the
# run's ``metrics/details.json`` artifact instead, and a family indexed by set size (``sets/gain/caface/n=16/rank1``)
# becomes one curve over that size (``sets/gain/caface/rank1`` at step 16), which the chart view draws.
DETAIL = re.compile(r"(^|/)(n_\w+|\w*ci_(low|high)|std|shuffles|pairs|impostor_pairs|count|reference_size)$"
                    r"|^validate/leakage/")
SIZE_STEP = re.compile(r"/n=(\d+)(?=/|$)")
DETAILS_ARTIFACT = "metrics/details.json"


def split_summary(metrics: Mapping[str, float]) -> tuple[dict[str, float], dict[str, dict[int, float]],
                                                          dict[str, float]]:
    """A stage's summary metrics as MLflow gets them → (columns, curves ``{key: {step: value}}``, details).

    Keys are MLflow's (``mlflow_metric_name``); details keep the stage's own key."""
    columns: dict[str, float] = {}
    curves: dict[str, dict[int, float]] = {}
    details: dict[str, float] = {}
    for key, value in metrics.items():
        if value is None:
            continue
        if DETAIL.search(key):
            details[key] = float(value)
        elif (size := SIZE_STEP.search(key)) is not None:
            name = mlflow_metric_name(key[:size.start()] + key[size.end():])
            curves.setdefault(name, {})[int(size.group(1))] = float(value)
        else:
            columns[mlflow_metric_name(key)] = float(value)
    return columns, curves, details


def log_summary(metrics: Mapping[str, float], details: dict[str, float] | None = None) -> None:
    """Log ``split_summary(metrics)`` to the active MLflow run: columns at step 0, curves at their sizes, details
    added to ``details`` (the run's details so far) and written as its ``metrics/details.json``."""
    import mlflow

    columns, curves, new = split_summary(metrics)
    if columns:
        mlflow.log_metrics(columns)
    for key, points in curves.items():
        for step, value in sorted(points.items()):
            mlflow.log_metric(key, value, step=step)
    if new:
        details = {} if details is None else details
        details.update(new)
        mlflow.log_dict(dict(sorted(details.items())), DETAILS_ARTIFACT)


def summary_rows(metrics: Mapping[str, float], timestamp_ms: int) -> tuple[list[Any], dict[str, float]]:
    """``split_summary(metrics)`` as rows for ``MlflowClient.log_batch`` (columns at step 0, curves at their sizes)
    → (rows, details)."""
    from mlflow.entities import Metric

    columns, curves, details = split_summary(metrics)
    rows = [Metric(k, v, timestamp_ms, 0) for k, v in columns.items()]
    rows += [Metric(k, v, timestamp_ms, step) for k, points in curves.items() for step, v in points.items()]
    return rows, details


def _same(a: float, b: float) -> bool:
    """Equal as logged values: NaN equals NaN, and a float32 rounding (a tensor's ``.item()``) is no change."""
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


class _Tracker:
    """What a stage may log; ``StageTracker`` logs to MLflow, ``JournalTracker`` to the relay's journal."""

    run_id: str | None = None

    def log_dataset(self, dataset_dir: Path, context: str) -> str:
        raise NotImplementedError

    def log_prepared_datasets(self, prepared: Path) -> None:
        """Log every dataset directory ``prepare`` wrote (``train``, ``heldout``, ``templates``, ``discovery``,
        ``videos``, ``unaligned``, ``fusion``, ``real``)."""
        for sub in ("train", "heldout", "templates", "discovery", "videos", "unaligned", "fusion", "real"):
            if (prepared / sub / "dataset.json").is_file():
                self.log_dataset(prepared / sub, context=sub)


class StageTracker(_Tracker):
    """Thin logging facade over the active MLflow run of one stage execution (in this thread).

    Metrics logged with a ``step`` are curves; one logged without is a summary, which MLflow puts at step 0. A
    stage's summary repeats its curves' final values (the last epoch's ``train/loss``), and at step 0 these would
    start every chart at the final value. So a summary value of a curve key is dropped when it equals the curve's
    last point and otherwise appended one step after it, and a point equal to a curve's last one (same step, same
    value: Lightning adds ``epoch`` to both its step and its epoch-end logs) is not logged twice. Every curve's
    steps strictly increase; summary keys without a curve go to step 0, split by ``split_summary`` into columns,
    set-size curves and the run's ``metrics/details.json``.
    """

    def __init__(self, run_id: str, root: Path):
        self.run_id = run_id
        self.root = root
        self._curves: dict[str, tuple[int, float]] = {}  # MLflow key → (last step, last value) logged with a step
        self._details: dict[str, float] = {}  # what metrics/details.json holds so far

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import mlflow

        if step is not None:
            clean = {mlflow_metric_name(k): float(v) for k, v in metrics.items() if v is not None}
            new = {k: v for k, v in clean.items() if self._curves.get(k, (None, None))[0] != step
                   or not _same(v, self._curves[k][1])}
            if new:
                mlflow.log_metrics(new, step=step)
            self._curves.update({k: (int(step), v) for k, v in new.items()})
            return
        clean = {k: v for k, v in metrics.items() if mlflow_metric_name(k) not in self._curves}
        log_summary(clean, self._details)
        for key, value in metrics.items():
            key = mlflow_metric_name(key)
            if key in self._curves and value is not None and not _same(float(value), self._curves[key][1]):
                last = self._curves[key][0] + 1
                mlflow.log_metric(key, float(value), step=last)
                self._curves[key] = (last, float(value))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        if Path(path).is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        import mlflow

        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_dataset(self, dataset_dir: Path, context: str) -> str:
        """Log a faceops dataset directory as an MLflow input (manifest + content digest)."""
        import mlflow

        from ml.data.dataset import read_dataset_info, read_manifest

        info = read_dataset_info(dataset_dir)
        manifest = read_manifest(dataset_dir / "manifest.parquet")
        view = manifest.drop(columns=["landmarks"])
        with warnings.catch_warnings():
            # two of MLflow's own sources (file and local artifact) both claim a local path, and its schema
            # inference hints that integer columns cannot hold missing values: neither is ours to act on
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
            ds = mlflow.data.from_pandas(view, source=str(Path(dataset_dir).resolve()), name=f"{info['name']}",
                                         digest=info["digest"][:36])
            mlflow.log_input(ds, context=context, tags={"faceops.digest": info["digest"]})
        mlflow.set_tag(f"dataset.{context}.digest", info["digest"])
        return info["digest"]

    def log_model_dir(
        self, model_dir: Path, registered_name: str, *, alias: str = "candidate", tags: Mapping[str, str] = {}
    ) -> str:
        """Log a faceops embedding model directory as an MLflow pyfunc model and register a new version.

        The model carries its serving contract (``ops.pyfunc``): the signature uint8 (-1, S, S, 3) RGB images →
        float32 (-1, D) L2-normalised embeddings and a one-image input example. The version gets ``alias``
        (``candidate``) and ``tags``; returns the version number.
        """
        import mlflow

        from ops.pyfunc import FaceEmbedder, input_example, signature

        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=FaceEmbedder(),
            artifacts={"model_dir": str(model_dir)},
            signature=signature(model_dir),
            input_example=input_example(model_dir),
            pip_requirements=["faceops", "torch==2.13.0", "safetensors", "numpy"],
            registered_model_name=registered_name,
            await_registration_for=60,
        )
        version = str(info.registered_model_version)
        self._alias_and_tags(registered_name, version, alias, tags)
        return version

    def register_model_dir(
        self, registered_name: str, *, model_dir: Path | None = None, artifact_path: str = "model",
        alias: str = "candidate", tags: Mapping[str, str] = {},
    ) -> str:
        """Log ``model_dir`` under ``artifact_path`` of this run (if given; else it is already there) and register it
        (a faceops model that is not an image embedder, e.g. the fusion model) as a new version of
        ``registered_name``; → version number."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        if model_dir is not None:
            self.log_artifact(Path(model_dir), artifact_path=artifact_path)
        client = MlflowClient()
        try:
            client.create_registered_model(registered_name)
        except MlflowException as exc:
            if "already exists" not in str(exc).lower():
                raise
        mv = client.create_model_version(registered_name, source=f"runs:/{self.run_id}/{artifact_path}",
                                         run_id=self.run_id)
        version = str(mv.version)
        self._alias_and_tags(registered_name, version, alias, tags)
        return version

    def _alias_and_tags(self, name: str, version: str, alias: str, tags: Mapping[str, str]) -> None:
        from mlflow import MlflowClient

        client = MlflowClient()
        config = run_config(self.root)
        tags = {**tags, **config}
        policy = alias_policy()
        if policy or (policy is None and promotable(config["faceops.config"])):
            client.set_registered_model_alias(name, alias, version)
        else:  # a toy model (a smoke run) must not become what promotion judges in a shared registry
            tags = {**tags, "faceops.alias_withheld": alias}
            why = f"{ENV_MOVE_ALIASES}=0" if policy is False else f"params: {config['faceops.config']}"
            log.info("%s v%s registered without @%s (%s)", name, version, alias, why)
        for k, v in {**tags, "run_id": self.run_id}.items():
            client.set_model_version_tag(name, version, k, str(v))


class JournalTracker(_Tracker):
    """The stage side of a relayed run: every call becomes one JSON line in the journal (no MLflow import).

    Registry versions are assigned by the relay, so ``log_model_dir``/``register_model_dir`` return ``None``.
    """

    def __init__(self, path: Path):
        self._file = open(path, "a", encoding="utf-8")

    def write(self, op: str, *args: Any, **kwargs: Any) -> None:
        # one write() of a whole line: the relay never sees half an entry as complete
        self._file.write(json.dumps({"op": op, "args": args, "kwargs": kwargs}, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.write("log_metrics", {k: float(v) for k, v in metrics.items() if v is not None}, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.write("log_artifact", str(Path(path).resolve()), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.write("set_tags", {k: str(v) for k, v in tags.items()})

    def log_dataset(self, dataset_dir: Path, context: str) -> str:
        from ml.data.dataset import read_dataset_info

        self.write("log_dataset", str(Path(dataset_dir).resolve()), context=context)
        return read_dataset_info(dataset_dir)["digest"]

    def log_model_dir(
        self, model_dir: Path, registered_name: str, *, alias: str = "candidate", tags: Mapping[str, str] = {}
    ) -> None:
        self.write("log_model_dir", str(Path(model_dir).resolve()), registered_name, alias=alias, tags=dict(tags))

    def register_model_dir(
        self, registered_name: str, *, model_dir: Path | None = None, artifact_path: str = "model",
        alias: str = "candidate", tags: Mapping[str, str] = {},
    ) -> None:
        self.write("register_model_dir", registered_name, model_dir=str(Path(model_dir).resolve()) if model_dir else None,
                   artifact_path=artifact_path, alias=alias, tags=dict(tags))


def registered_note(name: str, version: str | None, alias: str = "candidate", root: Path | None = None) -> str:
    """``registered faceops-fr v3 @candidate``; with a relayed run the relay logs the version. ``root`` (the project,
    by default the working directory a stage runs in) tells whether its params let the alias move (``promotable``)."""
    policy = alias_policy()
    if policy is False:
        alias = f"{alias} withheld ({ENV_MOVE_ALIASES}=0)"
    elif policy is None:
        config = run_config(Path.cwd() if root is None else root)["faceops.config"]
        if not promotable(config):
            alias = f"{alias} withheld (params: {config})"
    return f"registered {name} v{version} @{alias}" if version else f"registering {name} @{alias} (version in the flow log)"


class _NoAdverts(logging.Filter):
    """Lightning logs "💡 Tip: ... try installing litlogger" at every fit whose loggers are not its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def lightning_logger(tracker: _Tracker) -> Any:
    """A Lightning logger that sends training curves through ``tracker`` (direct or journal)."""
    from lightning.pytorch.loggers.logger import Logger
    from lightning.pytorch.utilities import rank_zero_only

    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdverts) for f in lightning_log.filters):
        lightning_log.addFilter(_NoAdverts())

    class TrackerLogger(Logger):
        @property
        def name(self) -> str:
            return "faceops"

        @property
        def version(self) -> str:
            return tracker.run_id or "relayed"

        @rank_zero_only
        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            tracker.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

        @rank_zero_only
        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass  # the stage run already carries its params section

    return TrackerLogger()


def _stage_tags(stage: str, root: Path) -> dict[str, str]:
    commit = git_commit(root)
    tags = {"dvc.stage": stage, "faceops.stage": stage, "git.commit": commit,
            "mlflow.source.git.commit": commit.removesuffix("-dirty"), **run_config(root)}
    if os.environ.get(ENV_INVOCATION):
        tags["faceops.invocation"] = os.environ[ENV_INVOCATION]
    if os.environ.get(ENV_FLOW_RUN):
        tags["prefect.flow_run_id"] = os.environ[ENV_FLOW_RUN]
    if os.environ.get("DVC_EXP_NAME"):  # `dvc exp run`: the experiment `dvc exp show` lists this run under
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    torch = sys.modules.get("torch")  # the stage's thread count, as tasks.common.fix_stage_threads fixed it
    if torch is not None:
        tags["faceops.threads"] = str(torch.get_num_threads())
    return tags


def _start_run(stage: str, flat_params: Mapping[str, Any], tags: Mapping[str, str], parent: str | None) -> Any:
    import mlflow

    run = mlflow.start_run(run_name=stage, parent_run_id=parent or None, tags=dict(tags))
    # MLflow caps param values at 6000 chars; ours are short scalars and lists.
    mlflow.log_params({k: str(v)[:500] for k, v in flat_params.items()})
    return run


def summarise_on_experiment_parent(root: Path, parent_run_id: str) -> None:
    """When DVC runs this stage (``DVC_STAGE``) inside a ``dvc exp run``, add its unique summary numbers
    (``unique_summary``, split as a stage run's summary is) to the experiment's parent run. A failure is a warning:
    the stage's own run holds every number."""
    stage = os.environ.get("DVC_STAGE")
    if not stage:
        return
    from mlflow import MlflowClient

    from ops import lineage

    try:
        rows, _ = summary_rows(lineage.unique_summary(root, only=stage), int(time.time() * 1000))
        if rows:  # the details stay in the stage's own run
            MlflowClient().log_batch(parent_run_id, metrics=rows)
    except Exception as exc:  # noqa: BLE001 - the parent's summary is a view; the stage's run holds the numbers
        log.warning("could not add stage %s's numbers to its experiment's run %s: %s", stage, parent_run_id, exc)


@contextlib.contextmanager
def stage_run(stage: str, params: Mapping[str, Any], root: Path) -> Iterator[_Tracker]:
    """The MLflow run of one execution of ``stage`` (direct or through the journal, see the module docstring);
    it ends FAILED if the body raises."""
    flat: dict[str, Any] = {}
    _flatten("", params, flat)
    tags = _stage_tags(stage, root)
    if os.environ.get(ENV_JOURNAL):
        tracker = JournalTracker(Path(os.environ[ENV_JOURNAL]))
        tracker.write("start", stage, flat, tags)
        try:
            yield tracker
        except BaseException:
            tracker.write("end", "FAILED")
            raise
        else:
            tracker.write("end", "FINISHED")
        finally:
            tracker.close()
        return
    import mlflow

    from ops import lineage

    experiment_id = configure(root)
    parent = os.environ.get(ENV_PARENT_RUN)
    experiment_parent = None
    if not parent and os.environ.get("DVC_EXP_NAME"):  # `dvc exp run`: its stages nest under one run
        with store_creation_lock(tracking_uri(root)):
            parent = experiment_parent = lineage.experiment_parent(experiment_id, {
                "git.commit": tags["git.commit"], **run_config(root)})
    run = _start_run(stage, flat, tags, parent)
    try:
        yield StageTracker(run.info.run_id, root)
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    lineage.tag_from_dvc(root, run.info.run_id)  # dvc repro / dvc exp run: nothing reads dvc.lock after us
    if experiment_parent:
        summarise_on_experiment_parent(root, experiment_parent)
    mlflow.end_run()


class StageRelay:
    """The flow side of a journal: a thread that replays a stage process's tracking calls into MLflow.

    ``with StageRelay(root, parent_run_id) as relay:`` run the stage with ``relay.env`` added to its
    environment; leaving the block waits until every line is replayed. ``run_ids`` lists the runs it opened.
    A run whose process died without closing it ends ``KILLED``. If replaying fails, ``error`` holds why and
    the journal is kept (``path``) so it can be replayed later with ``StageRelay.replay``.
    """

    POLL_S = 0.1
    CALLS = frozenset({"log_metrics", "log_artifact", "set_tags", "log_dataset", "log_model_dir", "register_model_dir"})

    def __init__(self, root: Path, parent_run_id: str | None = None, logger: Any = None, path: Path | None = None):
        self.root = Path(root)
        self.parent = parent_run_id
        self.log = logger or log
        if path is None:
            fd, name = tempfile.mkstemp(prefix="faceops-journal-", suffix=".jsonl")
            os.close(fd)
            path = Path(name)
        self.path = Path(path)
        self.run_ids: list[str] = []
        self.error: BaseException | None = None
        self._tracker: StageTracker | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="faceops-mlflow-relay", daemon=True)

    @property
    def env(self) -> dict[str, str]:
        return {ENV_JOURNAL: str(self.path)}

    def __enter__(self) -> "StageRelay":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        if self.error is None:
            self.path.unlink(missing_ok=True)

    @classmethod
    def replay(cls, path: Path, root: Path, parent_run_id: str | None = None) -> "StageRelay":
        """Replay a kept journal into MLflow now (after the relay failed, e.g. the server was down)."""
        relay = cls(root, parent_run_id, path=path)
        relay._done.set()
        relay._thread.start()  # its own thread: MLflow's active-run stack is per thread
        relay._thread.join()
        if relay.error is not None:
            raise relay.error
        relay.path.unlink(missing_ok=True)
        return relay

    def _follow(self) -> None:
        import mlflow

        try:
            with MLFLOW_LOCK:
                configure(self.root)
            pending = ""
            with self.path.open("r", encoding="utf-8") as journal:
                while True:
                    finished = self._done.is_set()  # read after checking: a writer that has exited wrote everything
                    chunk = journal.read()
                    if chunk:
                        *lines, pending = (pending + chunk).split("\n")
                        for line in lines:
                            if line.strip():
                                with MLFLOW_LOCK:
                                    self._apply(json.loads(line))
                    elif finished:
                        break
                    else:
                        time.sleep(self.POLL_S)
            if self._tracker is not None:  # the stage process ended without closing its run
                with MLFLOW_LOCK:
                    mlflow.end_run("KILLED")
                self._tracker = None
        except BaseException as exc:  # keep the journal; the caller reports it
            self.error = exc
            if self._tracker is not None:
                with contextlib.suppress(Exception):
                    mlflow.end_run("FAILED")

    def _apply(self, entry: Mapping[str, Any]) -> None:
        import mlflow

        op, args, kwargs = entry.get("op"), list(entry.get("args", [])), dict(entry.get("kwargs", {}))
        if op == "start":
            stage, flat, tags = args
            run = _start_run(stage, flat, tags, self.parent)
            self._tracker = StageTracker(run.info.run_id, self.root)
            self.run_ids.append(run.info.run_id)
        elif op == "end":
            mlflow.end_run(args[0])
            self._tracker = None
        elif op in self.CALLS and self._tracker is not None:
            if op in ("log_artifact", "log_dataset", "log_model_dir"):
                args[0] = Path(args[0])
            result = getattr(self._tracker, op)(*args, **kwargs)
            if op in ("log_model_dir", "register_model_dir"):
                name = args[1] if op == "log_model_dir" else args[0]
                self.log.info(registered_note(name, result, kwargs.get("alias", "candidate"), self.root))
        else:
            raise ValueError(f"{self.path}: unexpected journal entry {op!r} (outside a run or unknown)")
