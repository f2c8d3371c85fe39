"""The pipeline as a Prefect flow: the DAG comes from ``dvc.yaml``, each stage is reproduced through DVC.

There is no second DAG: ``stage_graph`` reads DVC's own stage graph, and each stage is one Prefect task that
does what ``dvc repro --single-item <stage>`` does: DVC decides whether the stage is out of date (its status:
deps, params, cmd, outs against ``dvc.lock``); an out-of-date stage is first looked up in DVC's run-cache, as
``dvc repro`` does (``Stage.run`` → ``repo.stage_cache.restore``): when an earlier run of the same cmd with the same
deps and params left its outputs in DVC's cache (a param changed and changed back), they are checked out and
recorded in ``dvc.lock`` and the cmd does not run (``restore_stage``; ``force`` skips the lookup, as
``dvc repro --force`` does). Otherwise the stage's ``cmd`` runs and DVC commits the result (outputs into its cache,
hashes into ``dvc.lock``, the run into the run-cache). DVC stays the truth for what is up to date and what was
produced. Unlike ``dvc repro``, DVC's repository lock is held only for the status check, the restore and the
commit, not while the stage runs, so independent stages (``train_aligner`` beside ``train_fr@real``; discovery,
fusion and the generator after it) run at the same time, up to ``jobs`` at once. Prefect adds the flow run, one
visible task per stage, retries and logs; MLflow gets a parent run per flow run under which each stage's run nests
(a restored stage's run is tagged ``dvc.restored=true`` and carries the metrics of its restored metrics files).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flows import routing
from tasks import tracking
from tasks.common import ENV_CORE_SHARE

# one DVC operation at a time in this process: DVC's Repo is not thread-safe (the file lock guards other processes)
_DVC = threading.Lock()


class _Slots:
    """At most ``n`` stages in progress at once. A freed slot goes to the ready stage with the longest chain of
    stages still to come after it (the critical path first; ties: first come). A stage whose upstream stages have
    all just finished counts as ready before its task arrives (Prefect starts it a moment later), so a stage that
    was already waiting with a shorter chain cannot take the slot from under it; that expectation lapses after
    ``grace`` seconds."""

    def __init__(self, n: int, graph: dict[str, list[str]] | None = None, grace: float = 30.0) -> None:
        self._free = max(1, n)
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
            while not (self._free > 0 and min(self._queue()) == ticket):
                self._cond.wait(timeout=1.0)  # re-check: expectations lapse
            self._waiting.remove(ticket)
            self._free -= 1
            self._cond.notify_all()
        finished = False
        try:
            yield
            finished = True
        finally:
            with self._cond:
                self._free += 1
                if finished:
                    self._finish(stage)
                self._cond.notify_all()

    def _finish(self, stage: str) -> None:
        self._done.add(stage)
        for down, ups in self._graph.items():
            if stage in ups and all(u in self._done for u in ups):
                self._expected[down] = time.monotonic() + self._grace


class _CoreShare:
    """The cores split between the stage commands running at once, at most ``jobs`` of them: each stage gets a
    file holding its share (``tasks.common.ENV_CORE_SHARE``), rewritten whenever a stage starts or finishes; the
    trainers re-read it (``ml.train.callbacks.FollowCoreShare``), so a stage left running alone takes all the
    cores. The share is also the stage's starting ``OMP_NUM_THREADS``. A user's ``OMP_NUM_THREADS`` wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, Path] = {}
        self._dir: Path | None = None
        self.jobs = 1

    def _share(self) -> int:
        cores = os.cpu_count() or 1
        return max(1, cores // max(1, min(len(self._files), self.jobs)))

    def enter(self, key: str) -> tuple[int, Path]:
        with self._lock:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="faceops-cores-"))
            self._files[key] = self._dir / f"{key}.threads"
            self._rewrite()
            return self._share(), self._files[key]

    def leave(self, key: str) -> None:
        with self._lock:
            path = self._files.pop(key, None)
            if path is not None:
                path.unlink(missing_ok=True)
            self._rewrite()

    def _rewrite(self) -> None:
        share = str(self._share())
        for path in self._files.values():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(share)
            os.replace(tmp, path)


_SLOTS = {"pool": _Slots(1)}
_CORES = _CoreShare()


class StageFailed(RuntimeError):
    pass


def check_dvc_yaml(root: Path) -> None:
    """ConfigError naming ``dvc.yaml`` and the stage when the file is not YAML or a stage lacks its ``cmd`` or its
    ``deps``. DVC accepts a stage without deps, but it would never rerun it when its code or inputs change, and the
    flow (whose DAG is DVC's) would start it without waiting for the stages that write its inputs."""
    import yaml

    from ml.errors import ConfigError
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
        with _DVC, Repo(str(root)) as repo:
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

    with _DVC, Repo(str(root)) as repo:
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

    with _DVC, Repo(str(root)) as repo:
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

    with _DVC, Repo(str(root)) as repo, lock_repo(repo):
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
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage, {})
    return {d["path"]: d.get("md5") or d.get("hash", "") for d in entry.get(kind, [])}


def stage_env(root: Path, invocation: str, parent_run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # DVC runs `python -m tasks.x` through the shell: make that the interpreter running this flow
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env[tracking.ENV_INVOCATION] = invocation
    env.setdefault("TQDM_MININTERVAL", "5")  # progress bars become log lines here: one every few seconds
    env["PYTHONUNBUFFERED"] = "1"  # Lightning's bar writes to stdout, block-buffered on a pipe otherwise
    env.setdefault("MLFLOW_TRACKING_URI", tracking.tracking_uri(root))
    if parent_run_id:
        env[tracking.ENV_PARENT_RUN] = parent_run_id
    if flow_run.id:
        env[tracking.ENV_FLOW_RUN] = str(flow_run.id)
    return env


@task(retries=0, task_run_name="{stage}")
def reproduce_stage(stage: str, root: str, parent_run_id: str | None = None, force: bool = False
                    ) -> dict[str, Any]:
    """Reproduce one stage through DVC (see the module docstring): nothing runs when DVC finds it up to date, and
    an out-of-date stage whose run DVC's run-cache holds is restored from it (unless ``force``). → ``{"stage",
    "ran": its cmd ran, "restored": its outputs came from the run-cache, "seconds"}``.

    The stage's MLflow run is relayed through this process (``tasks.tracking.StageRelay``): the stage writes
    a journal, this task replays it into MLflow while the stage works. Stages running side by side share the
    cores (``_CoreShare``); when slots are scarce, the stage on the longest remaining chain starts first.
    A GPU stage runs on the GPU work pool instead when one is configured (``flows.routing``): it takes no slot.
    """
    deployment = routing.dispatch_target(stage)
    if deployment is not None:
        return routing.dispatch_stage(stage, Path(root), deployment, parent_run_id, force)
    with _SLOTS["pool"].hold(stage):
        return _reproduce(stage, Path(root), parent_run_id, force)


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
    key = f"{stage}-{uuid.uuid4().hex[:8]}"
    threads, share_file = _CORES.enter(key)
    try:
        logger.info("%s: running `%s` (%s) with %d thread(s) to start", stage, cmd, "; ".join(reasons) or "--force",
                    threads)
        rc, tail, relay = run_relayed(["/bin/sh", "-c", cmd], root, parent_run_id, logger, threads=threads,
                                      share_file=share_file)
    finally:
        _CORES.leave(key)
    if rc != 0:
        errors = [l for l in tail if l.startswith(("error:", "ERROR"))]
        raise StageFailed(f"stage '{stage}' failed (exit {rc}): {(errors or tail[-1:] or ['no output'])[-1]}"
                          f"{routing.mlflow_note(root, relay.run_ids)}")
    try:
        commit_stage(root, stage)
    except Exception as exc:  # e.g. an output the cmd did not write
        raise StageFailed(f"stage '{stage}' ran but DVC could not record its outputs: {exc}") from exc
    if relay.error is not None:
        raise StageFailed(f"stage '{stage}' ran and DVC recorded its outputs, but logging it to MLflow failed "
                          f"({relay.error}); its tracking journal is kept at {relay.path}: replay it with "
                          f"tasks.tracking.StageRelay.replay once MLflow is reachable")
    if relay.run_ids:
        _retrying(_tag_stage_runs, root, stage, relay.run_ids)
    seconds = time.perf_counter() - start
    logger.info("%s: ran in %.1fs", stage, seconds)
    return {"stage": stage, "ran": True, "restored": False, "seconds": seconds}


def run_relayed(
    cmd: list[str], root: Path, parent_run_id: str | None, logger: Any, threads: int | None = None,
    share_file: Path | None = None,
) -> tuple[int, list[str], tracking.StageRelay]:
    """Run a stage command with its output streamed to ``logger`` and its MLflow run relayed through this
    process; → (exit code, the last 40 lines, the relay). ``threads`` caps the stage's BLAS/OpenMP (torch)
    threads at start and ``share_file`` holds its share as it changes (see ``_CoreShare``), so stages running side
    by side do not oversubscribe the cores; a user's OMP_NUM_THREADS overrides both."""
    with tracking.StageRelay(root, parent_run_id, logger) as relay:
        env = {**stage_env(root, uuid.uuid4().hex, parent_run_id), **relay.env}
        if "OMP_NUM_THREADS" not in os.environ:
            if threads:
                env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            if share_file is not None:
                env[ENV_CORE_SHARE] = str(share_file)
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
    """Tag the stage's MLflow runs with DVC's hashes of its dependencies and outputs, and the model versions those
    runs registered with the hashes of their model directories (known only once dvc.lock is written): a
    registered model's ``dvc.out.models/...`` is the md5 ``dvc.lock`` holds for it."""
    from mlflow import MlflowClient

    with _DVC:
        deps, outs = dvc_lock_deps(root, stage), dvc_lock_deps(root, stage, "outs")
    tags = {**{f"dvc.dep.{p}": md5 for p, md5 in deps.items()}, **{f"dvc.out.{p}": md5 for p, md5 in outs.items()}}
    models = {f"dvc.out.{p}": md5 for p, md5 in outs.items() if p.startswith("models/")}
    with tracking.MLFLOW_LOCK:
        client = MlflowClient(tracking_uri=tracking.tracking_uri(root))
        for run_id in run_ids:
            for key, md5 in tags.items():
                client.set_tag(run_id, key, md5)
            if not models:
                continue
            for version in client.search_model_versions(f"run_id = '{run_id}'"):
                for key, md5 in models.items():
                    client.set_model_version_tag(version.name, version.version, key, md5)


def restored_record(root: Path, stage: str, metrics_files: list[str]) -> tuple[dict[str, str], dict[str, float]]:
    """(params, metrics) for the MLflow run of a restored stage: its params as ``dvc.lock`` records them, flattened
    as a stage's own run logs its params section (``fr.lr``), and the numbers in its restored ``metrics_files``
    (``metrics/train_fr_real.json``; a file holding a ``metrics`` mapping beside its settings contributes that
    mapping), nested keys joined with ``/``."""
    import yaml

    with _DVC:
        lock = root / "dvc.lock"
        entry = ((yaml.safe_load(lock.read_text()) or {}) if lock.is_file() else {}).get("stages", {}).get(stage, {})
    params: dict[str, str] = {}
    for values in (entry.get("params") or {}).values():  # {params.yaml: {section or dotted key: value}}
        _flat_items(values, ".", params)
    metrics: dict[str, float] = {}
    for rel in metrics_files:
        path = root / rel
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise StageFailed(f"stage '{stage}' was restored from DVC's run-cache but its metrics file {path} cannot "
                              f"be read ({exc}); run the stage with --force to write it again") from exc
        if isinstance(doc, dict) and isinstance(doc.get("metrics"), dict):
            doc = doc["metrics"]
        flat: dict[str, Any] = {}
        _flat_items(doc if isinstance(doc, dict) else {}, "/", flat)
        metrics.update({tracking.mlflow_metric_name(k): float(v) for k, v in flat.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: str(v)[:500] for k, v in params.items()}, metrics


def _flat_items(value: dict[str, Any], sep: str, out: dict[str, Any], prefix: str = "") -> None:
    for key, item in value.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(item, dict):
            _flat_items(item, sep, out, name)
        else:
            out[name] = item


def log_restored_stage(root: Path, stage: str, parent_run_id: str | None, params: dict[str, str],
                       metrics: dict[str, float]) -> str:
    """The MLflow run of a stage restored from DVC's run-cache (its cmd did not run, so no stage process opened
    one): named, nested and tagged like a stage's own run, plus ``dvc.restored=true`` and, when this store holds
    it, ``dvc.restored_from``: the run that produced the restored outputs (the earliest run of the stage tagged
    with the same output hash). → the run id. ``_tag_stage_runs`` adds DVC's hashes afterwards."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    commit = tracking.git_commit(root)
    tags = {"dvc.stage": stage, "faceops.stage": stage, "git.commit": commit,
            "mlflow.source.git.commit": commit.removesuffix("-dirty"), "dvc.restored": "true"}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
    outs = dvc_lock_deps(root, stage, "outs")
    with tracking.MLFLOW_LOCK:
        client = MlflowClient(tracking_uri=tracking.tracking_uri(root))
        experiment_id = (client.get_run(parent_run_id).info.experiment_id if parent_run_id else
                         tracking.configure(root))
        source = _producing_run(client, experiment_id, stage, outs)
        if source:
            tags["dvc.restored_from"] = source
        run = client.create_run(experiment_id, run_name=stage, tags=tags)
        now = int(time.time() * 1000)
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                         params=[Param(k, v) for k, v in params.items()])
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


def apply_params(root: Path, preset: str | None, params_delta: dict[str, str] | None, logger: Any) -> None:
    """Write ``preset`` then ``params_delta`` (dotted key → YAML value, as `faceops run --set` takes them) into
    ``root``'s params.yaml, as the CLI does; an unknown section or key raises ConfigError naming it before anything
    is written. It edits the working copy the flow runs in: a deployment's run starts from a fresh clone."""
    from tasks.params import apply_delta, load_preset, parse_assignments

    delta = load_preset(preset, root) if preset else {}
    delta.update(parse_assignments([f"{key}={value}" for key, value in (params_delta or {}).items()]))
    if delta:
        for key, (old, new) in apply_delta(root / "params.yaml", delta).items():
            logger.info("params.yaml: %s: %r → %r", key, old, new)


def benchmark_markdown(report: str, tables: int = 2) -> str:
    """The head of a benchmark report (title, when it was generated) and its first ``tables`` sections holding a
    table (the models and their verification accuracy), with a pointer to the rest."""
    head, *sections = re.split(r"^(?=## )", report, flags=re.MULTILINE)
    with_table = [s for s in sections if re.search(r"^\|", s, flags=re.MULTILINE)]
    kept = "".join(with_table[:tables]).rstrip()
    rest = len(sections) - len(with_table[:tables])
    return f"{head.rstrip()}\n\n{kept}\n\n_{rest} more section(s) in `reports/benchmark.md`._\n"


def publish_benchmark(root: Path) -> None:
    """This flow run's ``benchmark`` markdown artifact (Prefect UI → Artifacts), from reports/benchmark.md."""
    from prefect.artifacts import create_markdown_artifact

    report = root / "reports" / "benchmark.md"
    markdown = (benchmark_markdown(report.read_text(encoding="utf-8")) if report.is_file() else
                "No benchmark yet: the `evaluate` stage writes `reports/benchmark.md`; run it (stage `evaluate`).")
    create_markdown_artifact(markdown=markdown, key="benchmark", description="faceops benchmark (reports/benchmark.md)")


@flow(name="faceops-pipeline")
def pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False, jobs: int = 1,
             params_delta: dict[str, str] | None = None, preset: str | None = None) -> list[dict[str, Any]]:
    """Reproduce the DVC pipeline (all stages, or ``stages`` and what they need); a stage starts as soon as the
    stages it depends on have finished, up to ``jobs`` at once (the critical path first when more are ready),
    sharing the cores; an out-of-date stage whose run DVC's run-cache holds is restored from it unless ``force``.
    ``preset`` then ``params_delta`` (e.g. ``{"fr.epochs": "2"}``) are written into params.yaml first
    (``apply_params``). GPU stages run on the GPU work pool when ``FACEOPS_GPU_DEPLOYMENT`` is set. The run ends with
    a ``benchmark`` artifact.

    Args:
        root: the repository root.
        stages: only these dvc.yaml stages and what they need, e.g. ["evaluate"]; empty: all of them.
        force: rerun the stages even when DVC finds them up to date (no run-cache restore either).
        jobs: how many independent stages run at once.
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g. {"fr.epochs": "20"}.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke.
    """
    import mlflow

    logger = get_run_logger()
    root_path = Path(root).resolve()
    apply_params(root_path, preset, params_delta, logger)
    if deployment := routing.gpu_deployment():
        logger.info("GPU stages run on deployment %s", deployment)
    if publish := routing.publish_requested():  # a throw-away clone: no remote, nothing of this run would survive
        routing.require_remote(root_path)
    graph = stage_graph(root_path)
    order = list(graph)
    if stages:
        unknown = [s for s in stages if s not in graph]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has {order}")
        keep = _with_upstream(graph, stages)
        order = [s for s in order if s in keep]
    logger.info("stages in dependency order: %s", " → ".join(order))
    _SLOTS["pool"] = _Slots(jobs, {s: [u for u in graph[s] if u in order] for s in order})
    _CORES.jobs = max(1, jobs)
    tracking.configure(root_path)
    with mlflow.start_run(run_name="pipeline", tags={
        "prefect.flow_run_id": str(flow_run.id), "faceops.kind": "pipeline", "git.commit": tracking.git_commit(root_path),
    }) as parent:
        started = time.perf_counter()
        futures: dict[str, Any] = {}
        for stage in order:
            upstream = [futures[u] for u in graph[stage] if u in futures]
            futures[stage] = reproduce_stage.submit(stage, str(root_path), parent.info.run_id, force,
                                                    wait_for=upstream)
        results, failure = [], None
        for stage in order:  # dependency order: the first failure reported is the root cause
            state = futures[stage].wait() or futures[stage].state
            if state.is_completed():
                results.append(futures[stage].result())
            elif failure is None:
                failure = futures[stage]
        if failure is not None:
            failure.result()  # raises the stage's StageFailed
        restored = [r["stage"] for r in results if r.get("restored")]
        logger.info("%d stage(s) ran, %d restored from DVC's run-cache%s, %d up to date",
                    sum(r["ran"] for r in results), len(restored), f" ({', '.join(restored)})" if restored else "",
                    sum(not r["ran"] and not r.get("restored") for r in results))
        mlflow.log_metrics({
            "pipeline/stages_ran": float(sum(r["ran"] for r in results)),
            "pipeline/stages_restored": float(len(restored)),
            # stages run side by side (`jobs` > 1): their times add up to more than the run's wall time
            "pipeline/stage_seconds_sum": float(sum(r["seconds"] for r in results)),
            "pipeline/wall_seconds": time.perf_counter() - started,
        })
    if publish:
        uploaded = routing.publish_outputs(root_path, [r["stage"] for r in results])
        logger.info("outputs in the DVC remote (%d file(s) uploaded); dvc.lock: artifact %s", uploaded,
                    routing.LOCK_KEY)
    publish_benchmark(root_path)
    return results


def run_pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False, jobs: int = 2
                 ) -> list[dict[str, Any]]:
    """``pipeline`` with up to ``jobs`` independent stages at once (1 = one after another). The task runner has a
    thread per stage (a task waiting for its upstream stages must not hold up a ready one); ``jobs`` slots limit
    how many run."""
    jobs = max(1, jobs)
    return pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=64))(
        root=root, stages=stages, force=force, jobs=jobs)


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


def _with_upstream(graph: dict[str, list[str]], stages: list[str]) -> set[str]:
    keep: set[str] = set()
    todo = list(stages)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += graph[name]
    return keep
