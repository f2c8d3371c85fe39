"""One pipeline stage reproduced in this process through DVC, as ``dvc repro --single-item <stage>`` would.

DVC decides whether the stage is out of date (its status: deps, params, cmd, outs against ``dvc.lock``); an
out-of-date stage is first looked up in DVC's run-cache, as ``dvc repro`` does (``Stage.run`` →
``repo.stage_cache.restore``): when an earlier run of the same cmd with the same deps and params left its outputs in
DVC's cache (a param changed and changed back), they are checked out and recorded in ``dvc.lock`` and the cmd does
not run (``restore_stage``; ``force`` skips the lookup, as ``dvc repro --force`` does). Otherwise the stage's ``cmd``
runs and DVC commits the result (outputs into its cache, hashes into ``dvc.lock``, the run into the run-cache). DVC
stays the truth for what is up to date and what was produced. Unlike ``dvc repro``, DVC's repository lock is held
only for the status check, the restore and the commit, not while the stage runs, so independent stages run at the
same time: up to ``jobs`` at once (``limit_jobs``), the critical path first; a stage params ``pipeline.exclusive``
lists waits until it can run alone. Each stage fixes its own thread count when it starts (``tasks.pipeline``), so what
runs beside it never changes its numerics. The stage's MLflow run
nests under the pipeline's (a restored stage's run is tagged ``dvc.restored=true`` and carries the metrics of its
restored metrics files). ``stage_graph`` is DVC's own stage graph: the flows have no second DAG.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from prefect import get_run_logger
from prefect.runtime import flow_run

from ml.errors import ConfigError, DataError
from ops import lineage, run_store, tracking
from ops.lineage import flat_items, stage_metrics  # flat_items: also flows.routing's

# one DVC operation at a time in this process: DVC's Repo is not thread-safe (the file lock guards other processes)
DVC_LOCK = threading.Lock()


class StageFailed(RuntimeError):
    pass


# ── how many stages at once ──


class _Slots:
    """At most ``n`` stages in progress at once; an ``exclusive`` stage takes all ``n`` (it runs alone). A freed
    slot goes to the ready stage with the longest chain of stages still to come after it (the critical path first;
    ties: first come); while the head of the queue is an exclusive stage waiting for the others to finish, no other
    stage starts. A stage whose upstream stages have all just finished counts as ready before its task arrives
    (Prefect starts it a moment later), so a stage that was already waiting with a shorter chain cannot take the
    slot from under it; that expectation lapses after ``grace`` seconds."""

    def __init__(self, n: int, graph: dict[str, list[str]] | None = None, grace: float = 30.0,
                 exclusive: frozenset[str] = frozenset()) -> None:
        self._n = self._free = max(1, n)
        self._exclusive = exclusive
        self._graph = graph or {}
        self._priority = _chain_lengths(self._graph) if self._graph else {}
        self._grace = grace
        self._waiting: list[tuple[int, float, str]] = []  # (-priority, arrival, stage): the smallest goes next
        self._expected: dict[str, float] = {}  # stage → when the expectation lapses
        self._done: set[str] = set()
        self._arrivals = 0
        self._cond = threading.Condition()

    def _queue(self) -> list[tuple[int, float, str]]:
        now = time.monotonic()
        self._expected = {s: t for s, t in self._expected.items() if t > now}
        # an expected stage ranks after a waiting one of the same priority (arrival = ∞)
        return self._waiting + [(-self._priority.get(s, 0), float("inf"), s) for s in self._expected]

    @contextlib.contextmanager
    def hold(self, stage: str) -> Iterator[None]:
        with self._cond:
            self._expected.pop(stage, None)
            ticket = (-self._priority.get(stage, 0), float(self._arrivals), stage)
            self._arrivals += 1
            self._waiting.append(ticket)
            need = self._n if stage in self._exclusive else 1
            while not (self._free >= need and min(self._queue()) == ticket):
                self._cond.wait(timeout=1.0)  # re-check: expectations lapse
            self._waiting.remove(ticket)
            self._free -= need
            self._cond.notify_all()
        finished = False
        try:
            yield
            finished = True
        finally:
            with self._cond:
                self._free += need
                if finished:
                    self._finish(stage)
                self._cond.notify_all()

    def _finish(self, stage: str) -> None:
        self._done.add(stage)
        for down, ups in self._graph.items():
            if stage in ups and all(u in self._done for u in ups):
                self._expected[down] = time.monotonic() + self._grace


_SLOTS = {"pool": _Slots(1)}


def limit_jobs(jobs: int, graph: dict[str, list[str]], exclusive: tuple[str, ...] = ()) -> None:
    """From now on, at most ``jobs`` stages of ``graph`` (``{stage: [upstream stages]}``) run at once, the critical path
    first, and each stage in ``exclusive`` alone (``_Slots``)."""
    _SLOTS["pool"] = _Slots(jobs, graph, exclusive=frozenset(exclusive))


@contextlib.contextmanager
def stage_slot(stage: str) -> Iterator[None]:
    """Hold ``stage``'s slot (``limit_jobs``) while the block runs it, here or on a work pool."""
    with _SLOTS["pool"].hold(stage):
        yield


def _chain_lengths(graph: dict[str, list[str]]) -> dict[str, int]:
    """Per stage, the number of stages on the longest chain that still depends on it (0 for a last stage)."""
    downstream: dict[str, list[str]] = {s: [] for s in graph}
    for stage, ups in graph.items():
        for up in ups:
            downstream[up].append(stage)
    lengths: dict[str, int] = {}
    for stage in reversed(list(graph)):  # graph is in dependency order: every downstream stage is done first
        lengths[stage] = max((1 + lengths[d] for d in downstream[stage]), default=0)
    return lengths


# ── DVC ──


def check_dvc_yaml(root: Path) -> None:
    """ConfigError naming ``dvc.yaml`` and the stage when the file is not YAML or a stage lacks its ``cmd`` or its
    ``deps``. DVC accepts a stage without deps, but it would never rerun it when its code or inputs change, and the
    flow (whose DAG is DVC's) would start it without waiting for the stages that write its inputs."""
    from tasks.common import yaml_error

    path = Path(root) / "dvc.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; the pipeline's stages are declared there")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({yaml_error(exc)}). Fix it or `git checkout dvc.yaml`.") from exc
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise ConfigError(f"{path}: no 'stages' mapping; it declares the pipeline's stages (`git checkout dvc.yaml`)")
    for name, stage in stages.items():
        body = stage.get("do") if isinstance(stage, dict) and "foreach" in stage else stage
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: stage '{name}' must be a mapping with cmd, deps and outs")
        if not body.get("cmd"):
            raise ConfigError(f"{path}: stage '{name}' has no cmd; give the command that runs it, e.g. "
                              f"`python -m tasks.{name}`")
        if not isinstance(body.get("deps"), list) or not body["deps"]:
            raise ConfigError(f"{path}: stage '{name}' declares no deps; DVC would not rerun it when its code or "
                              "inputs change, and the flow would not wait for the stages that write its inputs. "
                              "List them under deps: its code (tasks/...) and the data it reads.")


def stage_graph(root: Path) -> dict[str, list[str]]:
    """``{stage: [the stages it directly depends on]}`` in dependency order (``train_fr@real`` for foreach stages),
    from DVC's graph; ``.dvc`` files are data, not stages. A ``dvc.yaml`` that DVC cannot read, or whose stages
    lack a cmd or deps (``check_dvc_yaml``), raises ConfigError naming it."""
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    from ml.errors import ConfigError

    check_dvc_yaml(root)
    try:
        with DVC_LOCK, Repo(str(root)) as repo:
            graph = repo.index.graph  # edge A → B: A depends on B
            order = [s for s in reversed(list(nx.topological_sort(graph))) if not s.addressing.endswith(".dvc")]
            return {s.addressing: [u.addressing for u in graph.successors(s) if not u.addressing.endswith(".dvc")]
                    for s in order}
    except DvcException as exc:
        cause = f": {exc.__cause__}" if exc.__cause__ is not None and str(exc.__cause__) not in str(exc) else ""
        detail = " ".join(f"{exc}{cause}".split())
        raise ConfigError(f"{Path(root) / 'dvc.yaml'}: DVC cannot read the pipeline ({detail})") from exc


def stage_order(root: Path) -> list[str]:
    """Stage names in dependency order."""
    return list(stage_graph(root))


def stage_status(root: Path, stage: str) -> tuple[list[str], str]:
    """(why DVC finds ``stage`` out of date — empty when it is up to date —, its cmd)."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(str(root)) as repo:
        (target,) = repo.stage.collect(stage)
        status = repo.status(targets=[stage])
        reasons = []
        for entry in status.get(stage, []):
            reasons += [f"{k}: {', '.join(v) if isinstance(v, dict) else v}" for k, v in entry.items()] \
                if isinstance(entry, dict) else [str(entry)]
        cmd = target.cmd if isinstance(target.cmd, str) else " && ".join(target.cmd)
        return reasons, cmd


def commit_stage(root: Path, stage: str) -> None:
    """``dvc commit --force STAGE``: outputs into DVC's cache, their hashes and the deps' into ``dvc.lock``."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(str(root)) as repo:
        repo.commit(stage, force=True)


def restore_stage(root: Path, stage: str) -> list[str] | None:
    """What ``dvc repro`` does for an out-of-date stage before it would run its cmd (``Stage.run`` →
    ``repo.stage_cache.restore``): when DVC's run-cache holds a run of the stage's cmd with its current deps and
    params, and that run's outputs are in DVC's cache, check them out and record the stage in ``dvc.lock`` (as
    ``dvc repro`` does after a restore). → the stage's metrics files (paths from ``root``) when it was restored;
    None when there is no such run: then nothing was touched and the cmd has to run."""
    from dvc.exceptions import ConfirmRemoveError
    from dvc.repo import Repo, lock_repo
    from dvc.stage.cache import RunCacheNotFoundError

    with DVC_LOCK, Repo(str(root)) as repo, lock_repo(repo):
        (target,) = repo.stage.collect(stage)
        try:
            repo.stage_cache.restore(target)
        except RunCacheNotFoundError:
            return None
        except ConfirmRemoveError:
            # a hit, but the workspace holds outputs DVC's cache has no copy of (a failed run's half-written files):
            # `dvc repro` removes a stage's outputs before restoring, so do that and restore again. The first try
            # wrote the deps' new hashes into its stage object, so the second starts from a fresh one.
            (target,) = repo.stage.collect(stage)
            target.remove_outs(ignore_remove=False, force=False)
            repo.stage_cache.restore(target)
        target.save()  # deps and outs hashed; the run-cache already holds this run
        target.commit()
        target.dump(update_pipeline=False)  # dvc.lock
        return [str(out.def_path) for out in target.outs if out.is_metric]


def dvc_lock_deps(root: Path, stage: str, kind: str = "deps") -> dict[str, str]:
    """``{path: md5}`` of ``stage``'s ``kind`` (``deps`` or ``outs``) as DVC recorded them in ``dvc.lock``."""
    entry = read_lock(root).get(stage, {})
    return {d["path"]: d.get("md5") or d.get("hash", "") for d in entry.get(kind, [])}


def read_lock(root: Path) -> dict[str, Any]:
    """The ``stages`` of ``root``'s dvc.lock (empty without one)."""
    path = root / "dvc.lock"
    return ((yaml.safe_load(path.read_text()) or {}).get("stages") or {}) if path.is_file() else {}


# ── running one here ──


def reproduce_here(stage: str, root: Path, parent_run_id: str | None, force: bool) -> dict[str, Any]:
    """Reproduce ``stage`` in this process (see the module docstring) once a slot is free (``limit_jobs``);
    → ``{"stage", "ran": its cmd ran, "restored": its outputs came from the run-cache, "seconds"}``."""
    with stage_slot(stage):
        return _reproduce(stage, root, parent_run_id, force)


def stage_env(root: Path, invocation: str, parent_run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # DVC runs `python -m tasks.x` through the shell: make that the interpreter running this flow
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env[tracking.ENV_INVOCATION] = invocation
    env.setdefault("TQDM_MININTERVAL", "5")  # progress bars become log lines here: one every few seconds
    env["PYTHONUNBUFFERED"] = "1"  # Lightning's bar writes to stdout, block-buffered on a pipe otherwise
    env.setdefault("MLFLOW_TRACKING_URI", run_store.tracking_uri(root))
    if parent_run_id:
        env[tracking.ENV_PARENT_RUN] = parent_run_id
    if flow_run.id:
        env[tracking.ENV_FLOW_RUN] = str(flow_run.id)
    return env


def _reproduce(stage: str, root: Path, parent_run_id: str | None, force: bool) -> dict[str, Any]:
    logger = get_run_logger()
    start = time.perf_counter()
    reasons, cmd = stage_status(root, stage)
    if not reasons and not force:
        logger.info("%s: up to date (stage didn't change, skipping)", stage)
        return {"stage": stage, "ran": False, "restored": False, "seconds": time.perf_counter() - start}
    if not force:
        try:
            metrics_files = restore_stage(root, stage)
        except Exception as exc:  # e.g. DVC's cache lacks an object the run-cache entry names
            raise StageFailed(f"stage '{stage}': DVC could not restore it from its run-cache ({exc}); run it with "
                              f"--force to run its cmd instead of restoring") from exc
        if metrics_files is not None:
            params, metrics = restored_record(root, stage, metrics_files)
            run_id = _retrying(log_restored_stage, root, stage, parent_run_id, params, metrics)
            _retrying(_tag_stage_runs, root, stage, [run_id])
            seconds = time.perf_counter() - start
            logger.info("%s: restored from DVC's run-cache in %.1fs, its cmd did not run (%s); MLflow run %s", stage,
                        seconds, "; ".join(reasons), run_id)
            return {"stage": stage, "ran": False, "restored": True, "seconds": seconds}
    logger.info("%s: running `%s` (%s)", stage, cmd, "; ".join(reasons) or "--force")
    rc, tail, relay = run_relayed(["/bin/sh", "-c", cmd], root, parent_run_id, logger)
    if rc != 0:
        errors = [l for l in tail if l.startswith(("error:", "ERROR"))]
        raise StageFailed(f"stage '{stage}' failed (exit {rc}): {(errors or tail[-1:] or ['no output'])[-1]}"
                          f"{mlflow_note(root, relay.run_ids)}")
    try:
        commit_stage(root, stage)
    except Exception as exc:  # e.g. an output the cmd did not write
        raise StageFailed(f"stage '{stage}' ran but DVC could not record its outputs: {exc}") from exc
    if relay.error is not None:
        raise StageFailed(f"stage '{stage}' ran and DVC recorded its outputs, but logging it to MLflow failed "
                          f"({relay.error}); its tracking journal is kept at {relay.path}: replay it with "
                          f"ops.tracking.StageRelay.replay once MLflow is reachable")
    if relay.run_ids:
        _retrying(_tag_stage_runs, root, stage, relay.run_ids)
    seconds = time.perf_counter() - start
    logger.info("%s: ran in %.1fs", stage, seconds)
    return {"stage": stage, "ran": True, "restored": False, "seconds": seconds}


def run_relayed(cmd: list[str], root: Path, parent_run_id: str | None, logger: Any
                ) -> tuple[int, list[str], tracking.StageRelay]:
    """Run a stage command with its output streamed to ``logger`` and its MLflow run relayed through this
    process; → (exit code, the last 40 lines, the relay). The stage fixes its own threads (``tasks.pipeline``)."""
    with tracking.StageRelay(root, parent_run_id, logger) as relay:
        env = {**stage_env(root, uuid.uuid4().hex, parent_run_id), **relay.env}
        rc, tail = run_logged(cmd, root, env, logger)
    return rc, tail, relay


def run_logged(cmd: list[str], cwd: Path, env: dict[str, str], logger: Any) -> tuple[int, list[str]]:
    """Run ``cmd``, every output line to ``logger`` as it comes; → (exit code, the last 40 lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail: list[str] = []
    for line in _lines(proc.stdout):
        tail = (tail + [line])[-40:]
        logger.info(line)
    return proc.wait(), tail


def _lines(stream: Any) -> Iterator[str]:
    """Non-empty lines of a byte stream split at \\n *and* \\r, so progress bars reach the log as they advance."""
    pending = ""
    for chunk in iter(lambda: stream.read1(65536), b""):
        parts = re.split(r"[\r\n]", pending + chunk.decode("utf-8", errors="replace"))
        pending = parts.pop()
        yield from (p.rstrip() for p in parts if p.strip())
    if pending.strip():
        yield pending.rstrip()


def _tag_stage_runs(root: Path, stage: str, run_ids: list[str]) -> None:
    """Tag the stage's MLflow runs, and the model versions they registered, with DVC's hashes of its deps and outs
    as ``dvc.lock`` records them (written only once the stage has ended): ``ops.lineage.tag_runs``."""
    from mlflow import MlflowClient

    with DVC_LOCK:
        deps, outs = dvc_lock_deps(root, stage), dvc_lock_deps(root, stage, "outs")
    with tracking.MLFLOW_LOCK:
        lineage.tag_runs(MlflowClient(tracking_uri=run_store.tracking_uri(root)), run_ids, deps, outs)


def restored_record(root: Path, stage: str, metrics_files: list[str]) -> tuple[dict[str, str], dict[str, float]]:
    """(params, metrics) for the MLflow run of a restored stage: its params as ``dvc.lock`` records them, flattened
    as a stage's own run logs its params section (``fr.lr``), and the numbers in its restored ``metrics_files``
    (``stage_metrics``)."""
    with DVC_LOCK:
        entry = read_lock(root).get(stage, {})
    params: dict[str, Any] = {}
    for values in (entry.get("params") or {}).values():  # {params.yaml: {section or dotted key: value}}
        params.update(flat_items(values))
    try:
        metrics = stage_metrics(root, metrics_files)
    except DataError as exc:
        raise StageFailed(f"stage '{stage}' was restored from DVC's run-cache but {exc}; run the stage with --force "
                          "to write it again") from exc
    return {k: str(v)[:500] for k, v in params.items()}, metrics


def log_restored_stage(root: Path, stage: str, parent_run_id: str | None, params: dict[str, str],
                       metrics: dict[str, float]) -> str:
    """The MLflow run of a stage restored from DVC's run-cache (its cmd did not run, so no stage process opened
    one): named, nested, tagged and its metrics split (``tracking.split_summary``) like a stage's own run, plus
    ``dvc.restored=true`` and, when this store holds it, ``dvc.restored_from``: the run that produced the restored
    outputs (the earliest run of the stage tagged with the same output hash). → the run id. ``_tag_stage_runs`` adds
    DVC's hashes afterwards."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    commit = tracking.git_commit(root)
    tags = {"dvc.stage": stage, "faceops.stage": stage, "git.commit": commit,
            "mlflow.source.git.commit": commit.removesuffix("-dirty"), "dvc.restored": "true"}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
    outs = dvc_lock_deps(root, stage, "outs")
    with tracking.MLFLOW_LOCK:
        client = MlflowClient(tracking_uri=run_store.tracking_uri(root))
        experiment_id = (client.get_run(parent_run_id).info.experiment_id if parent_run_id else
                         run_store.configure(root))
        source = _producing_run(client, experiment_id, stage, outs)
        if source:
            tags["dvc.restored_from"] = source
        run = client.create_run(experiment_id, run_name=stage, tags=tags)
        now = int(time.time() * 1000)
        rows, details = tracking.summary_rows(metrics, now)  # as the stage's own run logged its summary
        client.log_batch(run.info.run_id, metrics=rows, params=[Param(k, v) for k, v in params.items()])
        if details:
            client.log_dict(run.info.run_id, dict(sorted(details.items())), tracking.DETAILS_ARTIFACT)
        client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _producing_run(client: Any, experiment_id: str, stage: str, outs: dict[str, str]) -> str | None:
    """The earliest run of ``stage`` not itself a restore whose ``dvc.out.*`` tag holds the first output's hash."""
    path, md5 = next(iter(outs.items()), (None, None))
    if not path or not md5:
        return None
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time ASC"], max_results=50,
                              filter_string=f"tags.`dvc.stage` = '{stage}' AND tags.`dvc.out.{path}` = '{md5}'")
    return next((r.info.run_id for r in runs if r.data.tags.get("dvc.restored") != "true"), None)


def _retrying(fn: Callable[..., Any], *args: Any, delays: tuple[float, ...] = (2.0, 8.0, 30.0)) -> Any:
    """``fn(*args)``, tried again after each of ``delays`` seconds while it raises. For MLflow writes inside a
    stage's task: a Prefect task with retries would add a task run per stage to the flow run."""
    for delay in delays:
        try:
            return fn(*args)
        except Exception as exc:  # transient: a locked SQLite store, a restarting tracking server
            get_run_logger().warning("%s failed (%s); trying again in %.0fs", fn.__name__, exc, delay)
            time.sleep(delay)
    return fn(*args)


# ── links to a stage's records ──


def _without_credentials(uri: str) -> str:
    """``uri`` with any ``user:password@`` removed: links end up in logs and in the Prefect UI."""
    parts = urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def mlflow_run_link(tracking_uri: str, run_id: str) -> str:
    """Where to open an MLflow run: a UI link for a tracking server (MLflow's ``#/runs/<id>`` page, which opens
    the run in its experiment), the ``mlflow ui`` command for a local store."""
    uri = _without_credentials(tracking_uri).rstrip("/")
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return f"{uri}/#/runs/{run_id}"
    if scheme == "sqlite" or scheme == "" or scheme == "file":
        return (f"run {run_id} (`mlflow ui --backend-store-uri {uri}`, then "
                f"http://127.0.0.1:5000/#/runs/{run_id})")
    return f"run {run_id} in {uri}"


def mlflow_note(root: Path, run_ids: list[str]) -> str:
    """``"; MLflow: <link>"`` for the stage's last MLflow run, or nothing when it opened none."""
    return f"; MLflow: {mlflow_run_link(run_store.tracking_uri(root), run_ids[-1])}" if run_ids else ""
