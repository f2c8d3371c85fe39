"""``faceops``: the human entry point. Heavy libraries are imported inside commands, so ``--help`` is instant."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="faceops",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    help=(
        "**faceops** — reproducible face-recognition research pipelines.\n\n"
        "The stage DAG lives in `dvc.yaml` (prepare → validate → train_fr@real → evaluate), its configuration in "
        "`params.yaml`. Every stage execution is an MLflow run (store: `mlflow.db`, or `MLFLOW_TRACKING_URI`).\n\n"
        "Typical use:\n\n"
        "* `faceops run` — reproduce the whole pipeline as a Prefect flow (skips what DVC finds up to date)\n\n"
        "* `faceops run --set fr.epochs=2` — the same with a params delta (like `dvc exp run -S`)\n\n"
        "* `faceops run --preset smoke` — the whole DAG at toy size in under two minutes\n\n"
        "* `faceops stage train_fr@real` — run one stage's code directly (what `dvc repro` calls)\n\n"
        "* `faceops ls` — stages and their status, datasets, models and registry versions\n\n"
        "* `faceops export models/fr/real fr.onnx` — ONNX export with a parity check"
    ),
)


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _quiet_env() -> None:
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        # without PREFECT_API_URL a flow starts a temporary local Prefect server: give it time on a busy machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    }.items():
        os.environ.setdefault(key, value)


def _root() -> Path:
    root = Path.cwd()
    if not (root / "dvc.yaml").is_file():
        _fail(f"no dvc.yaml in {root}: run faceops from the repository root.")
    return root


@app.command()
def run(
    set_: Annotated[list[str], typer.Option("--set", "-S", help="params delta SECTION.KEY=VALUE (repeatable), e.g. `fr.epochs=2`")] = [],
    preset: Annotated[Optional[str], typer.Option(help="named delta from presets.yaml, e.g. `smoke`")] = None,
    stage: Annotated[list[str], typer.Option("--stage", help="only this stage and what it needs (repeatable)")] = [],
    force: Annotated[bool, typer.Option(help="rerun stages even if DVC finds them up to date")] = False,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="independent stages run at once (1 = one after another)")] = 2,
) -> None:
    """Reproduce the pipeline as a Prefect flow, one task per `dvc.yaml` stage.

    Deltas (`--preset`, then `--set`) are written into `params.yaml` with comments kept, as `dvc exp run -S`
    does; `git checkout params.yaml` returns to the embedded default. Results: `reports/benchmark.md`,
    `metrics/`, `plots/`, `models/fr/`; runs in MLflow (`mlflow ui --backend-store-uri sqlite:///mlflow.db`) and,
    with `PREFECT_API_URL` set, in the Prefect UI. One run at a time per working copy: a second `faceops run` while
    one is in progress is refused (exit 3), naming it.
    """
    from faceops.runlock import RunLocked, run_lock
    from ml.errors import ConfigError, FaceopsError
    from tasks.common import load_params
    from tasks.params import apply_delta, check_params, load_preset, parse_assignments

    root = _root()
    _quiet_env()
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(run_lock(root))  # before the delta: a refused run leaves params.yaml alone
        except RunLocked as exc:
            _fail(str(exc), code=3)
        try:
            delta = load_preset(preset, root) if preset else {}
            delta.update(parse_assignments(set_))
            if delta:
                for key, (old, new) in apply_delta(root / "params.yaml", delta).items():
                    typer.echo(f"params.yaml: {key}: {old!r} → {new!r}")
            else:  # params.yaml as edited by hand: every section and key checked before any stage runs
                check_params(load_params(root / "params.yaml"))
            from flows.pipeline import stage_graph

            graph = stage_graph(root)  # dvc.yaml: readable, every stage with its cmd and deps
            unknown = [s for s in stage if s not in graph]
            if unknown:
                raise ConfigError(f"unknown stage {', '.join(map(repr, unknown))} for --stage; dvc.yaml has "
                                  f"{', '.join(graph)}")
        except FaceopsError as exc:
            _fail(str(exc))
        from flows.pipeline import StageFailed, run_pipeline

        try:
            results = run_pipeline(root=str(root), stages=stage or None, force=force, jobs=jobs)
        except StageFailed as exc:
            _fail(str(exc), code=1)
    typer.echo("")
    width = max((len(r["stage"]) for r in results), default=0)
    for r in results:
        typer.echo(f"  {r['stage']:<{width}}  {'ran' if r['ran'] else 'up to date':<11} {r['seconds']:6.1f}s")
    typer.echo("\nResults:")
    for label, path in [("benchmark report", "reports/benchmark.md"), ("metrics", "metrics/"), ("plots", "plots/"),
                        ("FR model", "models/fr/"), ("validation (Data Docs)", "reports/validation/docs/index.html")]:
        if (root / path).exists():
            typer.echo(f"  {label:<24} {root / path}")
    from tasks.sweep import mask_url  # a tracking URI may carry user:password@

    typer.echo(f"  {'MLflow runs':<24} {mask_url(os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite:///' + str(root / 'mlflow.db'))}")


@app.command("stage")
def stage_cmd(name: Annotated[str, typer.Argument(help="stage name from dvc.yaml, e.g. `prepare` or `train_fr@real`")]) -> None:
    """Run one stage's code directly, bypassing DVC's cache (this is what `dvc.yaml`'s cmd runs).

    To run a stage only when its inputs changed, use `dvc repro NAME` or `faceops run --stage NAME`.
    """
    from tasks import STAGES
    from tasks.common import stage_main

    base, _, item = name.partition("@")  # foreach stages: train_fr@real → tasks.train_fr.main("real")
    if base not in STAGES:
        _fail(f"unknown stage '{name}'. Stages: {', '.join(STAGES)} (foreach stages as NAME@ITEM, e.g. train_fr@real).")
    _root()
    _quiet_env()
    main = importlib.import_module(STAGES[base]).main
    stage_main((lambda: main(item)) if item else main)


@app.command("export")
def export_cmd(
    model_dir: Annotated[Path, typer.Argument(help="a faceops model directory, e.g. `models/fr/real`")],
    out: Annotated[Path, typer.Argument(help="the ONNX file to write, e.g. `fr_real.onnx`")],
    opset: Annotated[int, typer.Option(help="ONNX opset (14–20)")] = 17,
    check: Annotated[bool, typer.Option(help="compare onnxruntime with PyTorch (cosine ≥ 0.9999)")] = True,
) -> None:
    """Export a trained backbone to ONNX (KP-RPE models get a second input `keypoints`, 5×2 pixel landmarks).

    The graph takes `images` (B, 3, S, S) normalised as the input contract stored in the file's metadata says.
    """
    from ml.errors import FaceopsError
    from ml.models.export import export_model_dir, onnx_parity
    from ml.models.io import load_model

    try:
        path = export_model_dir(model_dir, out, opset=opset)
        typer.echo(f"wrote {path}")
        if check:
            cosine = onnx_parity(load_model(model_dir)[0], path)
            typer.echo(f"onnxruntime vs PyTorch: min cosine {cosine:.6f}")
            if cosine < 0.9999:
                _fail(f"parity check failed: min cosine {cosine:.6f} < 0.9999", code=1)
    except FaceopsError as exc:
        _fail(str(exc))


@app.command("ls")
def ls() -> None:
    """List stages (with DVC status), datasets, models and their MLflow registry versions."""
    import subprocess

    root = _root()
    _quiet_env()
    from flows.pipeline import stage_order
    from ml.errors import FaceopsError

    try:
        order = stage_order(root)
    except FaceopsError as exc:  # e.g. a dvc.yaml DVC cannot read, or a stage without deps
        _fail(str(exc))
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    changed = json.loads(status.stdout or "{}") if status.returncode == 0 else {}
    typer.secho("Stages", bold=True)
    for name in order:
        typer.echo(f"  {name:<16} {'changed' if name in changed else 'up to date'}")
    typer.secho("Datasets", bold=True)
    for info_path in sorted(root.glob("data/**/dataset.json")):
        info = json.loads(info_path.read_text())
        typer.echo(f"  {str(info_path.parent.relative_to(root)):<28} {info.get('source'):<11} "
                   f"{info.get('identity_count')} ids, {info.get('image_count')} images, digest {str(info.get('digest'))[:12]}")
    typer.secho("Models", bold=True)
    for cfg_path in sorted(root.glob("models/**/config.json")):
        cfg = json.loads(cfg_path.read_text())
        kind = cfg.get("backbone") or f"{cfg.get('architecture')} ({cfg.get('kwargs', {}).get('backbone', '?')})"
        typer.echo(f"  {str(cfg_path.parent.relative_to(root)):<28} {kind}")
    typer.secho("Registry", bold=True)
    try:
        from mlflow import MlflowClient

        from tasks.tracking import configure

        configure(root)
        client = MlflowClient()
        for model in client.search_registered_models():
            by_version: dict[str, list[str]] = {}
            for alias, version in (model.aliases or {}).items():
                by_version.setdefault(str(version), []).append(alias)
            for v in client.search_model_versions(f"name = '{model.name}'"):
                aliases = ",".join(sorted(by_version.get(str(v.version), [])))
                typer.echo(f"  {model.name} v{v.version:<4} {('@' + aliases) if aliases else '':<12} "
                           f"source={v.tags.get('source', '?')} run={v.run_id[:8]}")
    except Exception as exc:  # registry unreachable is not fatal for a listing
        typer.echo(f"  (registry unavailable: {exc})")


# ── operations commands: one module per area beside this one (heavy imports inside the commands) ──
from faceops.sweep import sweep_command  # noqa: E402
app.command("sweep")(sweep_command)

from faceops.promote import promote_cmd  # noqa: E402

app.command("promote")(promote_cmd)

from faceops.stack import stack_app  # noqa: E402

app.add_typer(stack_app, name="stack")

from faceops.storage import app as data_app  # noqa: E402

app.add_typer(data_app, name="data")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
