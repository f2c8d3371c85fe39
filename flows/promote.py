"""The promotion flow: judge a registered model's ``@candidate`` against ``@champion`` and move the aliases.

Reads like the steps it takes (the work is in ``ops/promote``):

1. read the ``promote`` params section and check the model's whole gate against what its benchmarks produce —
   before anything is downloaded or written;
2. reach the tracking server (retried with exponential backoff, then a clear error naming the endpoint);
3. read the aliases; download ``@candidate``, ``@champion`` and, for fusion and generator gates, the FR champion;
4. run the gate's benchmarks on both models and decide;
5. record the decision (MLflow run, version tags) and move the aliases as one change, unless ``dry_run``;
6. publish the decision as a Prefect markdown artifact (key ``promote-<model>``).

``rollback=True`` instead moves ``@champion`` back to ``@previous`` (steps 2, 5, 6). Every MLflow call that is I/O
runs in a task retried on connection errors only (``promote.retries``, first delay ``promote.retry_delay_s``,
doubling); benchmark errors and config errors fail at once.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from ops import promote as p


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only when the failure is a connection problem (``ops.promote.is_transient``)."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:
        return False
    return isinstance(exc, BaseException) and p.is_transient(exc)


def _io(cfg: p.PromoteConfig) -> dict[str, Any]:
    """Task options for MLflow I/O: ``retries`` with exponential backoff (``retry_delay_s``, then doubling: 2, 4,
    8 s by default), only on connection errors."""
    return {"retries": cfg.retries, "retry_delay_seconds": exponential_backoff(backoff_factor=cfg.retry_delay_s),
            "retry_condition_fn": _transient}


@task(cache_policy=NONE)
def connect(root: str) -> str:
    """The tracking server answers; → its URI (password masked)."""
    return p.connect(Path(root))


@task(cache_policy=NONE, task_run_name="aliases of {name}")
def read_aliases(root: str, name: str, candidate_alias: str) -> p.RegistryState:
    return p.registry_state(p.client_for(Path(root)), name, candidate_alias)


@task(cache_policy=NONE, task_run_name="download {name} v{version}")
def download(name: str, version: str, dst: str) -> str:
    return str(p.download_version(name, version, Path(dst)))


@task(cache_policy=NONE, task_run_name="benchmark {role} v{version}")
def benchmark(key: str, model_dir: str, ctx: p.BenchContext, role: str, version: str) -> dict[str, float]:
    return p.run_benchmarks(key, model_dir, ctx)


@task(cache_policy=NONE, task_run_name="record decision")
def record(decision: p.Decision, state: p.RegistryState, root: str, flow_run_id: str | None) -> p.Decision:
    return p.record(decision, state, root=Path(root), flow_run_id=flow_run_id)


@task(cache_policy=NONE, task_run_name="roll back {name}")
def roll_back(name: str, root: str, flow_run_id: str | None, dry_run: bool) -> p.Rollback:
    return p.rollback(name, root=Path(root), flow_run_id=flow_run_id, dry_run=dry_run)


def _reach(root: str, cfg: p.PromoteConfig) -> str:
    try:
        return connect.with_options(**_io(cfg))(root)
    except p.RegistryUnreachable as exc:
        raise p.RegistryUnreachable(
            f"{exc} Gave up after {cfg.retries + 1} attempts (retries with backoff from {cfg.retry_delay_s:g} s; "
            "params promote.retries / promote.retry_delay_s).") from None


def _publish(name: str, markdown: str, description: str) -> None:
    create_markdown_artifact(markdown=markdown, key=f"promote-{name}", description=description)


@flow(name="promote", log_prints=False)
def promote_flow(model: str = "faceops-fr", rollback: bool = False, root: str = ".", candidate: str = p.CANDIDATE,
                 dry_run: bool = False) -> dict[str, Any]:
    """Promote ``model``'s ``@candidate`` (or another alias, e.g. ``candidate-synthetic``) when its gate passes, or
    with ``rollback`` restore ``@previous``. ``dry_run`` evaluates and reports without writing anything. Returns
    the decision's summary (``decision``: promoted | rejected | unchanged | rolled_back) with its ``markdown``.

    Args:
        model: the registered model, e.g. faceops-fr, faceops-generator, faceops-aligner, faceops-fusion,
            faceops-discovery (or its short name: fr, generator, …).
        rollback: move @champion back to @previous instead of judging a candidate.
        root: the repository root (on a worker: the clone its pull steps made).
        candidate: the alias of the version to judge, e.g. candidate or candidate-synthetic.
        dry_run: evaluate and report the decision without moving any alias.
    """
    logger = get_run_logger()
    root = str(Path(root).resolve())
    key = p.model_key(model)
    name = p.MODELS[key]
    cfg = p.load_config(Path(root))
    run_id = str(flow_run.id) if flow_run.id else None

    if rollback:
        _reach(root, cfg)
        plan = roll_back.with_options(**_io(cfg))(name, root, run_id, dry_run)
        logger.info(plan.headline())
        if not dry_run:
            _publish(name, plan.markdown(), f"rollback of {name}")
        return {**plan.summary(), "markdown": plan.markdown(), "headline": plan.headline()}

    ctx = p.bench_context(Path(root), cfg)
    directions = p.check_gate(key, ctx)  # the whole gate, before the registry is touched
    _reach(root, cfg)
    io = _io(cfg)
    state = read_aliases.with_options(**io)(root, name, candidate)
    version = p.require_candidate(state)
    if state.champion == version:
        decision = p.unchanged(key, state)
        logger.info(decision.headline())
        return {**decision.summary(), "markdown": decision.markdown(), "headline": decision.headline()}

    with tempfile.TemporaryDirectory(prefix="faceops-promote-") as tmp:
        if p.needs_fr(key, cfg):
            fr_state = read_aliases.with_options(**io)(root, p.MODELS["fr"], p.CANDIDATE)
            if fr_state.champion is None:
                raise p.PromotionError(f"the {name} gate embeds faces with faceops-fr@champion, and faceops-fr has no "
                                       "@champion yet: promote an FR model first (`faceops promote fr`).")
            fr_dir = download.with_options(**io)(p.MODELS["fr"], fr_state.champion, f"{tmp}/fr")
            ctx = dataclasses.replace(ctx, fr_dir=Path(fr_dir), fr_model=f"faceops-fr v{fr_state.champion}")
        cand_dir = download.with_options(**io)(name, version, f"{tmp}/candidate")
        cand = benchmark(key, cand_dir, ctx, "candidate", version)
        champ = None
        if state.champion is not None:
            champ_dir = download.with_options(**io)(name, state.champion, f"{tmp}/champion")
            champ = benchmark(key, champ_dir, ctx, "champion", state.champion)

    decision = p.decide(key, cfg.gate(key), directions, version, cand, state.champion, champ,
                        candidate_alias=candidate, fr_model=ctx.fr_model, dry_run=dry_run)
    if not dry_run:
        decision = record.with_options(**io)(decision, state, root, run_id)
    logger.info(decision.headline())
    if not dry_run:
        _publish(name, decision.markdown(), decision.headline())
    return {**decision.summary(), "markdown": decision.markdown(), "headline": decision.headline()}
