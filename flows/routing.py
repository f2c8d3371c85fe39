"""Where a stage runs — in the pipeline's own process, or on the ``gpu`` work pool — and where to see its records.

Which stages: ``GPU_STAGES``, the registry's (``tasks.STAGES``) GPU stages. When: ``FACEOPS_GPU_DEPLOYMENT`` names a
deployment of the ``stage`` flow below as ``FLOW/DEPLOYMENT``; unset, every stage runs in-process. An environment
variable, not a params key, on purpose: where a stage runs belongs to the machines, not to the experiment, and every
params key is a DVC dependency. How: workers share only the DVC remote and the servers. The pipeline pushes the
upstream outputs and starts a ``stage`` flow run with the commit, the params delta, the upstream ``dvc.lock``
entries and its MLflow run id; the worker's fresh clone checks out that commit, reproduces the stage as the pipeline
would, pushes its outputs and publishes a ``stage-result`` artifact (its ``dvc.lock`` entry and small uncached
files), which the pipeline adopts before pulling the outputs. With ``FACEOPS_PUBLISH_OUTPUTS=1`` a run also pushes
its outputs at the end and publishes its ``dvc.lock`` (``pipeline-lock``). See ``docs/operations/stack.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from flows.stages import DVC_LOCK, StageFailed, flat_items, read_lock, reproduce_here, stage_slot, stage_status
from ml.errors import ConfigError
from tasks import STAGES
from ops import run_store, tracking

ENV_GPU_DEPLOYMENT = "FACEOPS_GPU_DEPLOYMENT"
ENV_GIT_URL = "FACEOPS_GIT_URL"  # the repository the deployments' pull step clones (prefect.yaml)
GPU_STAGES = frozenset(name for name, stage in STAGES.items() if stage.gpu)  # tasks.STAGES: the registry
STAGE_FLOW = "stage"
RESULT_KEY = "stage-result"
ENV_PUBLISH = "FACEOPS_PUBLISH_OUTPUTS"
LOCK_KEY = "pipeline-lock"
MAX_RESULT_BYTES = 2_000_000  # uncached outputs travel inside the artifact: metrics and plot data, never models
IO_RETRY_DELAYS = [5, 20, 60]  # seconds before the 2nd, 3rd and 4th try of a DVC transfer


# ── the decision ──


def is_gpu_stage(stage: str) -> bool:
    return stage.partition("@")[0] in GPU_STAGES


def gpu_deployment() -> str | None:
    """The deployment GPU stages are dispatched to (``FACEOPS_GPU_DEPLOYMENT``), or None to run them in-process."""
    from prefect.settings import get_current_settings

    name = os.environ.get(ENV_GPU_DEPLOYMENT, "").strip()
    if not name:
        return None
    flow_name, _, deployment = name.partition("/")
    if not flow_name or not deployment or "/" in deployment:
        raise ConfigError(f"{ENV_GPU_DEPLOYMENT}={name!r}: expected FLOW/DEPLOYMENT, e.g. 'stage/stage-gpu' "
                          f"(`prefect deployment ls` lists them); unset it to run GPU stages in-process.")
    if not get_current_settings().api.url:
        raise ConfigError(f"{ENV_GPU_DEPLOYMENT}={name!r} but no Prefect server is configured (PREFECT_API_URL): "
                          f"dispatching a stage needs a server with a worker on the deployment's pool; set "
                          f"PREFECT_API_URL or unset {ENV_GPU_DEPLOYMENT}.")
    return name


def dispatch_target(stage: str) -> str | None:
    """The deployment to run ``stage`` on, or None to run it here: a GPU stage when a GPU deployment is configured,
    and never from inside a ``stage`` flow run (that is already the worker side)."""
    if not is_gpu_stage(stage):
        return None
    name = gpu_deployment()
    return None if name is None or flow_run.flow_name == STAGE_FLOW else name


@contextlib.contextmanager
def moving_aliases(move: bool | None) -> Iterator[None]:
    """``FACEOPS_MOVE_ALIASES`` for what runs inside (the stages, the flow's tracking relay, the stages dispatched to
    the GPU pool), restored after: True moves ``@candidate`` to new model versions, False never does, None leaves it
    to each run's params (``ops.run_config.promotable``: the default or a real preset, not a toy or a custom delta)."""
    before = os.environ.get(tracking.ENV_MOVE_ALIASES)
    os.environ[tracking.ENV_MOVE_ALIASES] = {True: "1", False: "0", None: "auto"}[move]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(tracking.ENV_MOVE_ALIASES, None)
        else:
            os.environ[tracking.ENV_MOVE_ALIASES] = before


def check_git_url() -> dict[str, str]:
    """A ``prefect deploy`` build step (prefect.yaml): say when ``FACEOPS_GIT_URL`` is unset, since every flow run
    of these deployments starts by cloning it; → ``{"git_url": value}`` for later steps."""
    import sys

    url = os.environ.get(ENV_GIT_URL, "").strip()
    if not url:
        sys.stderr.write(
            f"warning: {ENV_GIT_URL} is not set: every run of these deployments starts with `git clone "
            f"${ENV_GIT_URL}` on its worker, so each worker must have {ENV_GIT_URL} in its environment, or the run "
            f"fails before any stage. Set it to the repository the workers clone (a URL, or this checkout's path "
            f"for workers on this machine: `export {ENV_GIT_URL}=$PWD`); `faceops stack up --workers` sets it for "
            f"its workers.\n")
    return {"git_url": url}


# ── params, commits and dvc.lock between two working copies ──


def yaml_value(value: Any) -> str:
    """``value`` as the YAML text a params delta carries (``1e-05`` → ``1.0e-05``, ``""`` → ``''``), so that
    parsing it back gives exactly ``value``."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).removesuffix("...\n").strip()


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


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def params_delta_from_head(root: Path) -> dict[str, str]:
    """The params delta that turns the committed params.yaml into this working copy's: what a fresh clone of the
    same commit needs (dotted key → YAML value)."""
    try:
        committed = flat_items(yaml.safe_load(_git(root, "show", "HEAD:params.yaml")) or {})
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ConfigError(f"{root} is not a git clone with a committed params.yaml ({exc}): a stage dispatched to "
                          f"a worker is reproduced from a commit; commit params.yaml or unset {ENV_GPU_DEPLOYMENT}.")
    current = flat_items(yaml.safe_load((root / "params.yaml").read_text()) or {})
    removed = sorted(set(committed) - set(current))
    if removed:
        raise ConfigError(f"params.yaml lacks {', '.join(removed)}, which the commit has: a params delta cannot "
                          f"remove keys; restore them (`git diff params.yaml`).")
    return {k: yaml_value(v) for k, v in current.items() if k not in committed or committed[k] != v}


def code_commit(root: Path, logger: Any) -> str:
    """HEAD's sha; warns when files other than params.yaml and dvc.lock differ from it (a worker runs the commit)."""
    head = _git(root, "rev-parse", "HEAD").strip()
    changed = [line[3:] for line in _git(root, "status", "--porcelain", "--untracked-files=no").splitlines()]
    changed = [p for p in changed if p not in ("params.yaml", "dvc.lock")]
    if changed:
        logger.warning("uncommitted changes to %s are not seen by the GPU worker: it runs commit %s",
                       ", ".join(changed), head[:12])
    return head


def checkout_commit(root: Path, commit: str) -> None:
    """Make the worker's clone ``commit`` (fetched when the clone is at another one)."""
    head = _git(root, "rev-parse", "HEAD").strip()
    if head == commit:
        return
    try:
        _git(root, "fetch", "--quiet", "--depth", "1", "origin", commit)
        _git(root, "checkout", "--quiet", "--detach", commit)
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"this worker's clone is at {head[:12]}, the pipeline runs commit {commit[:12]}, and "
                          f"fetching it failed ({exc.stderr.strip()}): push that commit to the repository the "
                          f"workers clone (FACEOPS_GIT_URL).") from exc


def write_lock_entries(root: Path, entries: Mapping[str, Any]) -> None:
    """Set these stages' entries in ``root``'s dvc.lock (DVC's own format; other entries kept)."""
    from ml.atomic import atomic_path

    if not entries:
        return
    path = root / "dvc.lock"
    with DVC_LOCK:
        doc = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {"schema": "2.0"}
        doc.setdefault("stages", {}).update(entries)
        with atomic_path(path) as tmp:
            tmp.write_text(yaml.safe_dump(doc, sort_keys=False))


def _stage_node(repo: Any, stage: str) -> Any:
    for node in repo.index.graph:
        if node.addressing == stage:
            return node
    raise ConfigError(f"unknown stage '{stage}' in dvc.yaml")


def upstream_outputs(root: Path, stage: str) -> dict[str, list[str]]:
    """``{upstream stage: [its cached outputs]}`` for the stages ``stage`` directly depends on."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(str(root)) as repo:
        graph = repo.index.graph  # edge A → B: A depends on B
        return {up.addressing: [str(o.def_path) for o in up.outs if o.use_cache]
                for up in graph.successors(_stage_node(repo, stage)) if not up.addressing.endswith(".dvc")}


def stage_outputs(root: Path, stage: str) -> tuple[list[str], list[str]]:
    """(cached outputs, uncached outputs) of ``stage`` as dvc.yaml declares them."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(str(root)) as repo:
        outs = _stage_node(repo, stage).outs
        return [str(o.def_path) for o in outs if o.use_cache], [str(o.def_path) for o in outs if not o.use_cache]


def remote_needed_because() -> str:
    """Why this process needs a default DVC remote, naming the setting that asks for it (for the error message)."""
    if flow_run.flow_name == STAGE_FLOW:
        return (f"this is a stage dispatched from a pipeline on another worker ({ENV_GPU_DEPLOYMENT}): its inputs "
                f"and outputs travel through the default DVC remote")
    if publish_requested():
        return (f"{ENV_PUBLISH}=1 (prefect.yaml sets it for the deployments on work pool `cpu`): this run is in a "
                f"throw-away clone, so its datasets and models are pushed to the default DVC remote before the "
                f"clone is removed")
    return (f"{ENV_GPU_DEPLOYMENT} is set: a stage on another worker exchanges its data through the default DVC "
            f"remote; unset {ENV_GPU_DEPLOYMENT} to run GPU stages in-process")


def require_remote(root: Path) -> None:
    """Raise ConfigError, saying which setting needs it and how to add one, when ``root`` has no default DVC remote."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(str(root)) as repo:
        if not repo.config["core"].get("remote"):
            raise ConfigError(f"no default DVC remote in {root}/.dvc/config: {remote_needed_because()}. Add one "
                              f"(`dvc remote add -d storage s3://bucket/dvc`) and commit .dvc/config; on a laptop "
                              f"`faceops stack up --workers` gives its workers a local one.")


@task(retries=len(IO_RETRY_DELAYS), retry_delay_seconds=IO_RETRY_DELAYS, task_run_name="dvc push")
def dvc_push(root: str, targets: list[str]) -> int:
    """Push ``targets`` (DVC-tracked outputs) to the default remote; → how many files were uploaded."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(root) as repo:
        return repo.push(targets=targets)


@task(retries=len(IO_RETRY_DELAYS), retry_delay_seconds=IO_RETRY_DELAYS, task_run_name="dvc pull")
def dvc_pull(root: str, targets: list[str]) -> None:
    """Fetch ``targets`` from the default remote as dvc.lock records them and check them out (overwriting)."""
    from dvc.repo import Repo

    with DVC_LOCK, Repo(root) as repo:
        repo.pull(targets=targets, force=True)


# ── what a run in a throw-away clone leaves behind ──


def publish_requested() -> bool:
    return os.environ.get(ENV_PUBLISH, "").strip().lower() in ("1", "true", "yes")


def publish_outputs(root: Path, stages: list[str]) -> int:
    """Push ``stages``' cached outputs to the default DVC remote and publish dvc.lock as the flow run's
    ``pipeline-lock`` artifact; → how many files were uploaded."""
    from prefect.artifacts import create_markdown_artifact

    uploaded = dvc_push(str(root), stages) if stages else 0
    lock = (root / "dvc.lock").read_text(encoding="utf-8") if (root / "dvc.lock").is_file() else "stages: {}\n"
    create_markdown_artifact(
        key=LOCK_KEY, description="dvc.lock of this run: its outputs are in the DVC remote under these hashes",
        markdown=(f"### dvc.lock\n\nWrite this into a checkout of the run's commit, then `dvc pull` fetches its "
                  f"datasets and models ({uploaded} file(s) uploaded by this run).\n\n```yaml\n{lock}```\n"),
    )
    return uploaded


# ── the stage-result artifact ──


def publish_stage_result(stage: str, result: Mapping[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        key=RESULT_KEY,
        description=f"{stage}: dvc.lock entry and uncached outputs, read back by the dispatching pipeline",
        markdown=(f"### Stage `{stage}`\n\nIts dvc.lock entry and its uncached outputs; the cached outputs are in "
                  f"the DVC remote under the hashes below.\n\n```json\n{json.dumps(result, indent=1)}\n```\n"),
    )


def flow_run_url(flow_run_id: Any) -> str:
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=str(flow_run_id)) or f"flow run {flow_run_id}"


def read_stage_result(flow_run_id: Any) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[RESULT_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    if not found:
        raise ConfigError(f"{flow_run_url(flow_run_id)} completed without a '{RESULT_KEY}' artifact: its deployment "
                          f"must run flows/routing.py:run_stage_remote.")
    text = str(found[0].data)
    return json.loads(text[text.index("```json\n") + 8: text.rindex("\n```")])


def _uncached_files(root: Path, paths: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(text files, binary files as base64) under the uncached outputs ``paths``: metrics and plot data are text,
    a figure (``plots/*.png``, ``cache: false`` so that git holds it) is not."""
    import base64

    files: dict[str, str] = {}
    binary: dict[str, str] = {}
    for rel in paths:
        target = root / rel
        for path in sorted(target.rglob("*")) if target.is_dir() else [target]:
            if path.is_file():
                data = path.read_bytes()
                try:
                    files[str(path.relative_to(root))] = data.decode("utf-8")
                except UnicodeDecodeError:
                    binary[str(path.relative_to(root))] = base64.b64encode(data).decode("ascii")
    size = sum(len(text) for text in files.values()) + sum(len(text) for text in binary.values())
    if size > MAX_RESULT_BYTES:
        raise ConfigError(f"uncached outputs {', '.join(paths)} hold {size} bytes, too many to hand back through "
                          f"Prefect (max {MAX_RESULT_BYTES}): declare the large ones as cached outs in dvc.yaml.")
    return files, binary


def adopt_result(root: Path, stage: str, result: Mapping[str, Any]) -> None:
    """Make ``root`` as if ``stage`` had run there: its lock entry, its uncached files, its pulled outputs."""
    from ml.atomic import atomic_path

    import base64

    root = root.resolve()
    contents = {**{rel: text.encode("utf-8") for rel, text in result["files"].items()},
                **{rel: base64.b64decode(text) for rel, text in result.get("binary_files", {}).items()}}
    for rel, data in contents.items():
        target = (root / rel).resolve()
        if not target.is_relative_to(root):
            raise ConfigError(f"stage result for '{stage}' names a file outside the working copy: {rel}")
        with atomic_path(target) as tmp:
            tmp.write_bytes(data)
    write_lock_entries(root, {stage: result["lock"]})
    cached, _ = stage_outputs(root, stage)
    if cached:
        dvc_pull(str(root), cached)


# ── the two sides ──


@task(retries=0, task_run_name="{stage}")
def reproduce_stage(stage: str, root: str, parent_run_id: str | None = None, force: bool = False
                    ) -> dict[str, Any]:
    """Reproduce one stage through DVC: on the GPU work pool when it is a GPU stage and one is configured
    (``dispatch_stage``), else in this process (``flows.stages.reproduce_here``: nothing runs when DVC finds it up to
    date, an out-of-date stage whose run DVC's run-cache holds is restored from it unless ``force``, and its MLflow
    run is relayed through this process by ``ops.tracking.StageRelay``). → ``{"stage", "ran": its cmd ran,
    "restored": its outputs came from the run-cache, "seconds"}``. A dispatched stage holds its slot while it runs
    on the pool, so params ``pipeline.jobs`` and ``pipeline.exclusive`` hold across pools."""
    deployment = dispatch_target(stage)
    if deployment is not None:
        with stage_slot(stage):
            return dispatch_stage(stage, Path(root), deployment, parent_run_id, force)
    return reproduce_here(stage, Path(root), parent_run_id, force)


def dispatch_stage(stage: str, root: Path, deployment: str, parent_run_id: str | None, force: bool
                   ) -> dict[str, Any]:
    """Reproduce ``stage`` through ``deployment`` (steps 1 and 3 of the module docstring) and wait for it;
    → the pipeline's result for the stage. Nothing is dispatched when DVC finds the stage up to date."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    logger = get_run_logger()
    start = time.perf_counter()
    reasons, _ = stage_status(root, stage)
    if not reasons and not force:
        logger.info("%s: up to date (stage didn't change, skipping)", stage)
        return {"stage": stage, "ran": False, "seconds": time.perf_counter() - start}
    require_remote(root)
    upstream = upstream_outputs(root, stage)
    lock = read_lock(root)
    missing = [u for u in upstream if u not in lock]
    if missing:
        raise StageFailed(f"stage '{stage}': dvc.lock has no entry for {', '.join(missing)}, so a worker could "
                          f"not pull their outputs; reproduce them first (`faceops run --stage {missing[0]}`).")
    inputs = [path for outs in upstream.values() for path in outs]
    if inputs:
        dvc_push(str(root), inputs)
    parameters = {"stage": stage, "commit": code_commit(root, logger), "params_delta": params_delta_from_head(root),
                  "lock": {u: lock[u] for u in upstream}, "parent_run_id": parent_run_id, "force": force,
                  "move_aliases": tracking.alias_policy()}
    logger.info("%s: running on deployment %s (%s)", stage, deployment, "; ".join(reasons) or "--force")
    try:
        remote = run_deployment(deployment, parameters=parameters, timeout=None, poll_interval=2)
    except ObjectNotFound as exc:
        raise StageFailed(f"stage '{stage}': there is no deployment '{deployment}' ({ENV_GPU_DEPLOYMENT}) on the "
                          f"Prefect server: deploy it (`prefect deploy --name stage-gpu`) or unset "
                          f"{ENV_GPU_DEPLOYMENT} to run GPU stages in-process.") from exc
    url = flow_run_url(remote.id)
    if remote.state is None or not remote.state.is_completed():
        state = remote.state.name if remote.state else "no state"
        message = (remote.state.message if remote.state else None) or "no message"
        raise StageFailed(f"stage '{stage}' failed on {deployment} ({state}): {message}; Prefect flow run: {url}")
    result = read_stage_result(remote.id)
    adopt_result(root, stage, result)
    seconds = time.perf_counter() - start
    logger.info("%s: %s on %s in %.1fs (%s)", stage, "ran" if result["ran"] else "up to date", deployment,
                seconds, url)
    return {"stage": stage, "ran": result["ran"], "seconds": seconds}


def _reachable_parent(root: Path, parent_run_id: str | None, logger: Any) -> str | None:
    """``parent_run_id`` when this worker's MLflow store has it (the stage's run nests under it), else None."""
    if not parent_run_id:
        return None
    from mlflow import MlflowClient

    try:
        MlflowClient(tracking_uri=run_store.tracking_uri(root)).get_run(parent_run_id)
        return parent_run_id
    except Exception as exc:  # another store: the stage's run stands alone rather than failing the stage
        logger.warning("the pipeline's MLflow run %s is not in this worker's tracking store (%s): give the workers "
                       "the pipeline's MLFLOW_TRACKING_URI to nest the stage's run under it", parent_run_id, exc)
        return None


@flow(name=STAGE_FLOW, flow_run_name="{stage}")
def run_stage_remote(stage: str, root: str = ".", params_delta: dict[str, str] | None = None,
                     lock: dict[str, Any] | None = None, commit: str | None = None,
                     parent_run_id: str | None = None, force: bool = False, move_aliases: bool | None = None
                     ) -> dict[str, Any]:
    """Reproduce one pipeline stage on this worker (step 2 of the module docstring): check out ``commit``, apply
    ``params_delta``, pull the outputs the ``lock`` entries of the upstream stages record, reproduce the stage,
    push its outputs, publish its result as the ``stage-result`` artifact and return it.

    Args:
        stage: the dvc.yaml stage, e.g. train_fr@real.
        root: the repository root (the clone the deployment's pull steps made).
        params_delta: dotted params key → YAML value that turns the commit's params.yaml into the pipeline's.
        lock: dvc.lock entries of the stage's upstream stages (their outputs are pulled from the DVC remote).
        commit: the git commit the pipeline runs.
        parent_run_id: the pipeline's MLflow run, under which the stage's run nests.
        force: rerun the stage even when DVC finds it up to date.
        move_aliases: true moves `@candidate` to the stage's new model, false never does, empty leaves it to the
            run's params (the default or a real-data preset move it; the smoke preset or a custom delta do not).
    """
    logger = get_run_logger()
    path = Path(root).resolve()
    if commit:
        checkout_commit(path, commit)
    apply_params(path, None, params_delta, logger)
    require_remote(path)
    write_lock_entries(path, lock or {})
    inputs = [p for outs in upstream_outputs(path, stage).values() for p in outs]
    if inputs:
        dvc_pull(str(path), inputs)
    with moving_aliases(move_aliases):
        outcome = reproduce_stage(stage, str(path), _reachable_parent(path, parent_run_id, logger), force)
    cached, uncached = stage_outputs(path, stage)
    if cached:
        dvc_push(str(path), cached)
    files, binary = _uncached_files(path, uncached)
    result = {"ran": outcome["ran"], "lock": read_lock(path)[stage], "files": files, "binary_files": binary}
    publish_stage_result(stage, result)
    return {**outcome, "lock": result["lock"]}
