"""``faceops``: the human entry point. Heavy libraries are imported inside commands, so ``--help`` is instant."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from faceops.console import fail, quiet_env, repo_root

app = typer.Typer(
    name="faceops",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    help=(
        "**faceops** — reproducible face-recognition research pipelines.\n\n"
        "The stage DAG lives in `dvc.yaml`, its configuration in `params.yaml`: `prepare` → `validate` → "
        "`train_fr@real` (face recognition) and `train_aligner` (landmarks) → `align`; on `train_fr@real`: "
        "`train_discovery`, `train_fusion` (set fusion) and `train_generator` → `synthesize` → `train_fr@synthetic` "
        "and `train_fr@real_matched` (real faces at the synthetic set's budget); `evaluate` last, over every model (`faceops ls` lists them). Every stage execution is an MLflow run (store: "
        "`mlflow.db`, or `MLFLOW_TRACKING_URI`).\n\n"
        "Typical use:\n\n"
        "* `faceops run` — reproduce the whole pipeline as a Prefect flow (skips what DVC finds up to date, "
        "restores what its run-cache holds)\n\n"
        "* `faceops run --set fr.epochs=2` — the same with a params delta (like `dvc exp run -S`)\n\n"
        "* `faceops run --preset smoke` — the whole DAG at toy size in under two minutes\n\n"
        "* `faceops stage train_fr@real` — run one stage's code directly (what `dvc repro` calls)\n\n"
        "* `faceops ls` — stages and their status, datasets, models and registry versions\n\n"
        "* `faceops doctor` — this machine's facts, what `precision: auto` and the thread counts resolve to here\n\n"
        "* `faceops export models/fr/real fr.onnx` — ONNX export with a parity check\n\n"
        "* `faceops import sface.onnx --name sface --contract sface` — a pretrained recogniser as FR source `sface`"
    ),
)


def _unknown_stage(name: str, names: list[str], option: str = "") -> str:
    """The refusal of stage ``name`` (given with ``option``), suggesting the closest of ``names``."""
    import difflib

    items = [n for n in names if n.startswith(f"{name}@")]  # a foreach stage named without its item
    close = items or difflib.get_close_matches(name, names, n=3, cutoff=0.75)
    quoted = [repr(n) for n in close]
    listed = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else "".join(quoted)
    hint = f" Did you mean {listed}?" if close else ""
    return f"unknown stage '{name}'{f' for {option}' if option else ''}.{hint} dvc.yaml has {', '.join(names)}."


def _stage_names(root: Path) -> list[str] | None:
    """``dvc.yaml``'s stage names as DVC addresses them (``train_fr@real``), or None when DVC cannot read them
    (the stage then reports what is wrong itself)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    try:
        with Repo(str(root)) as repo:
            return [s.name for s in repo.index.stages if isinstance(s, PipelineStage)]
    except DvcException:
        return None


class _StageFailureEcho(logging.Filter):
    """Console only: Prefect logs a failed stage's StageFailed four times (two with a traceback); the command
    prints it once at the end. The Prefect API (the UI) still gets every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return type(exc).__name__ != "StageFailed" and "StageFailed" not in record.getMessage()


def _quiet_prefect_console() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _StageFailureEcho)
                                                                  for f in handler.filters):
            handler.addFilter(_StageFailureEcho())


def _undo_on_failure(undo: Any) -> Callable[..., bool]:
    """An ``__exit__`` that puts params.yaml back when the run fails (an error, a refusal, Ctrl-C)."""

    def exit_(exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None and undo.restore():
            typer.secho(f"{undo.path.name}: put back as it was before this run (the run did not succeed).", err=True)
        return False

    return exit_


@app.command()
def run(
    set_: Annotated[list[str], typer.Option("--set", "-S", help="params delta SECTION.KEY=VALUE (repeatable), e.g. `fr.epochs=2`")] = [],
    preset: Annotated[Optional[str], typer.Option(help="named delta from presets.yaml, e.g. `smoke`")] = None,
    stage: Annotated[list[str], typer.Option("--stage", help="only this stage and what it needs (repeatable)")] = [],
    force: Annotated[bool, typer.Option(help="rerun stages even if DVC finds them up to date")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="independent stages run at once (1 = one after another); the same as `--set pipeline.jobs=N`, and like it a new value reruns the stages: each stage's thread count follows it [default: params.yaml's pipeline.jobs]", show_default=False)] = None,
) -> None:
    """Reproduce the pipeline as a Prefect flow, one task per `dvc.yaml` stage.

    Deltas (`--preset`, then `--set`) are written into `params.yaml` as `dvc exp run -S` does, only the lines of
    the keys set changing; `git checkout params.yaml` returns to the embedded default. A run that fails puts
    `params.yaml` back as it was. Paths the stages read (`data.ingest_folder`, `evaluate.bin_dir`, ...) are checked
    before anything starts. Results: `reports/benchmark.md`,
    `metrics/`, `plots/`, `models/fr/`; runs in MLflow (`mlflow ui --backend-store-uri sqlite:///mlflow.db`) and,
    with `PREFECT_API_URL` set, in the Prefect UI. One run at a time per working copy: a second `faceops run` while
    one is in progress is refused (exit 3), naming it.
    """
    from faceops.runlock import RunLocked, run_lock
    from ml.errors import ConfigError, FaceopsError
    from tasks.common import load_params
    from tasks.params import ParamsUndo, apply_delta, check_input_paths, check_params, load_preset, parse_assignments

    root = repo_root()
    quiet_env()
    params_path = root / "params.yaml"
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(run_lock(root))  # before the delta: a refused run leaves params.yaml alone
        except RunLocked as exc:
            fail(str(exc), code=3)
        undo = ParamsUndo(params_path)
        held.push(_undo_on_failure(undo))  # runs before the lock is released
        try:
            delta = load_preset(preset, root) if preset else {}
            delta.update(parse_assignments(set_))
            if jobs is not None:
                delta["pipeline.jobs"] = jobs
            if delta:  # keys, types and input paths checked before params.yaml is written
                for key, (old, new) in apply_delta(params_path, delta).items():
                    typer.echo(f"params.yaml: {key}: {old!r} → {new!r}")
                undo.written()
            else:  # params.yaml as edited by hand: every section, key and input path checked before any stage runs
                params = load_params(params_path)
                check_params(params)
                check_input_paths(params, root)
            from flows.stages import stage_graph

            graph = stage_graph(root)  # dvc.yaml: readable, every stage with its cmd and deps
            for name in stage:
                if name not in graph:
                    raise ConfigError(_unknown_stage(name, list(graph), "--stage"))
        except FaceopsError as exc:
            fail(str(exc))
        from flows.pipeline import run_pipeline
        from flows.stages import StageFailed

        _quiet_prefect_console()
        try:
            results = run_pipeline(root=str(root), stages=stage or None, force=force)
        except StageFailed as exc:
            fail(str(exc), code=1)
    typer.echo("")
    width = max((len(r["stage"]) for r in results), default=0)
    for r in results:
        state = "restored" if r.get("restored") else "ran" if r["ran"] else "up to date"
        typer.echo(f"  {r['stage']:<{width}}  {state:<11} {r['seconds']:6.1f}s")
    typer.echo("\nResults:")
    for label, path in [("benchmark report", "reports/benchmark.md"), ("metrics", "metrics/"), ("plots", "plots/"),
                        ("FR model", "models/fr/"), ("validation (Data Docs)", "reports/validation/docs/index.html")]:
        if (root / path).exists():
            typer.echo(f"  {label:<24} {root / path}")
    from tasks.common import redact  # a tracking URI may carry user:password@

    typer.echo(f"  {'MLflow runs':<24} {redact(os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite:///' + str(root / 'mlflow.db'))}")


@app.command("stage")
def stage_cmd(name: Annotated[str, typer.Argument(help="stage name from dvc.yaml, e.g. `prepare` or `train_fr@real`")]) -> None:
    """Run one stage's code directly, bypassing DVC's cache (this is what `dvc.yaml`'s cmd runs).

    To run a stage only when its inputs changed, use `dvc repro NAME` or `faceops run --stage NAME`.
    """
    from tasks import STAGES
    from tasks.common import stage_main

    root = repo_root()
    names = _stage_names(root)
    base, _, item = name.partition("@")  # foreach stages: train_fr@real → tasks.train_fr.main("real")
    if names is not None and name not in names:
        fail(_unknown_stage(name, names))
    if base not in STAGES:
        fail(f"unknown stage '{name}'. Stages: {', '.join(STAGES)} (foreach stages as NAME@ITEM, e.g. train_fr@real).")
    quiet_env()
    main = importlib.import_module(STAGES[base].module).main
    stage_main((lambda: main(item)) if item else main, name)


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
                fail(f"parity check failed: min cosine {cosine:.6f} < 0.9999", code=1)
    except FaceopsError as exc:
        fail(str(exc))


# config.json "extra" keys shown by `faceops ls` (label, key), when the model has them: what it was trained on
MODEL_FACTS = (("source", "training_source"), ("data", "training_data_source"), ("data", "training_data"),
               ("fr", "fr_model"), ("init", "backbone_init"), ("space", "space"), ("ids", "training_identities"))
# model version tags shown by `faceops ls` (label, tag), as the stages set them when registering
VERSION_FACTS = (("source", "source"), ("backbone", "backbone"), ("fr", "fr_model"), ("init", "backbone_init"),
                 ("data", "training_data"), ("config", "faceops.config"))


def model_row(cfg: dict[str, Any]) -> tuple[str, str]:
    """(kind, facts) of a model directory's config.json: ``("vit_tiny", "source=real data=procedural ids=200
    64px digest=ac158c365b16")``. The kind is the backbone (FR models) or the model's own name (dfa, caface,
    facegcd, uiface; a diffusers folder's class, e.g. the generator's AutoencoderKL)."""
    kind = cfg.get("backbone") or cfg.get("architecture") or cfg.get("model") or cfg.get("_class_name") or "unknown"
    extra = cfg.get("extra") or {}
    facts = [f"{label}={extra[key]}" for label, key in MODEL_FACTS if extra.get(key) not in (None, "")]
    size = (cfg.get("input_contract") or {}).get("size") or (cfg.get("config") or {}).get("input_size")
    if size:
        facts.append(f"{size}px")
    if extra.get("training_data_digest"):
        facts.append(f"digest={str(extra['training_data_digest'])[:12]}")
    return str(kind), " ".join(facts)


def version_facts(tags: dict[str, str]) -> str:
    """What a registered model version was trained on, from its tags: ``source=real backbone=vit_tiny
    digest=ac158c365b16``."""
    facts = [f"{label}={tags[key]}" for label, key in VERSION_FACTS if tags.get(key)]
    if tags.get("data_digest"):
        facts.append(f"digest={tags['data_digest'][:12]}")
    if tags.get("faceops.alias_withheld"):  # a toy or custom run: registered, never a candidate
        facts.append(f"not @{tags['faceops.alias_withheld']}")
    return " ".join(facts)


def columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines, each column as wide as its widest cell (the last one unpadded), two spaces apart."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows]


@app.command("ls")
def ls() -> None:
    """List stages (with DVC status), datasets, models and their MLflow registry versions."""
    import subprocess

    root = repo_root()
    quiet_env()
    from flows.stages import stage_order
    from ml.errors import FaceopsError

    try:
        order = stage_order(root)
    except FaceopsError as exc:  # e.g. a dvc.yaml DVC cannot read, or a stage without deps
        fail(str(exc))
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    changed = json.loads(status.stdout or "{}") if status.returncode == 0 else {}
    typer.secho("Stages", bold=True)
    for line in columns([(name, "changed" if name in changed else "up to date") for name in order]):
        typer.echo(line)
    typer.secho("Datasets", bold=True)
    rows = []
    for info_path in sorted(root.glob("data/**/dataset.json")):
        info = json.loads(info_path.read_text())
        rows.append((str(info_path.parent.relative_to(root)), str(info.get("source") or "unknown"),
                     f"{info.get('identity_count')} ids, {info.get('image_count')} images, "
                     f"digest {str(info.get('digest'))[:12]}"))
    for line in columns(rows):
        typer.echo(line)
    typer.secho("Models", bold=True)
    rows = [(str(p.parent.relative_to(root)), *model_row(json.loads(p.read_text())))
            for p in sorted(root.glob("models/**/config.json"))]
    for line in columns(rows):
        typer.echo(line)
    typer.secho("Registry", bold=True)
    try:
        for line in columns(_registry_rows(root)) or ["  (no registered models)"]:
            typer.echo(line)
    except Exception as exc:  # registry unreachable is not fatal for a listing
        typer.echo(f"  (registry unavailable: {exc})")


def _registry_rows(root: Path) -> list[tuple[str, ...]]:
    """(name, version, @aliases, facts, run) per registered model version; none when the repository's own
    SQLite store does not exist yet (listing does not create it)."""
    from ops.run_store import tracking_uri

    uri = tracking_uri(root)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return []
    from mlflow import MlflowClient

    from ops.run_store import configure

    configure(root)
    client = MlflowClient()
    rows = []
    for model in client.search_registered_models():
        by_version: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        for v in sorted(client.search_model_versions(f"name = '{model.name}'"), key=lambda v: int(v.version)):
            aliases = ",".join(sorted(by_version.get(str(v.version), [])))
            rows.append((model.name, f"v{v.version}", f"@{aliases}" if aliases else "", version_facts(v.tags or {}),
                         f"run={(v.run_id or '')[:8]}"))
    return rows


# ── operations commands: one module per area beside this one (heavy imports inside the commands) ──
from faceops.sweep import sweep_command  # noqa: E402
app.command("sweep")(sweep_command)

from faceops.launch import launch_command  # noqa: E402

app.command("launch")(launch_command)

from faceops.promote import promote_cmd  # noqa: E402

app.command("promote")(promote_cmd)

from faceops.doctor import doctor_cmd  # noqa: E402

app.command("doctor")(doctor_cmd)

from faceops.imports import import_command  # noqa: E402

app.command("import")(import_command)

from faceops.plots import plots_cmd  # noqa: E402

app.command("plots")(plots_cmd)

from faceops.stack.cli import stack_app  # noqa: E402

app.add_typer(stack_app, name="stack")

from faceops.remote import app as data_app  # noqa: E402

app.add_typer(data_app, name="data")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
