"""Where UIFace's targets stand with time: ``faceops run --preset uiface-long`` beside the default run.

``python -m experiments.uiface_long --workspace DIR`` clones this checkout into DIR (when DIR does not exist), runs
``make setup`` there, then times ``faceops run --preset uiface-long`` (nothing else should run beside it: its wall
time is part of the result), and writes ``reports/uiface_long.md``, ``reports/uiface_long/synthetic_samples.png`` and
``metrics/uiface_long.json`` here: each target of docs/methods/generator.md for the default run (this checkout's
committed metrics) and for the long run side by side, then the long run's UIFace section as its own report renders
it (judges, Table 3, gates). ``--log FILE --wall-seconds S`` records a run already made in DIR (the ``faceops run``
output and its wall time) instead of running it. Chosen on: nothing (each generator keeps its last epoch). Scored on:
each run's own samples, judges and held-out verification pairs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.bench_default_run import machine_facts, stage_seconds, timed_run
from tasks.common import Paths, read_stage_metrics, write_json, write_text
from tasks.evaluate.synthetic import TARGETS, synthetic_section

PRESET = "uiface-long"
ROOT = Path(__file__).resolve().parents[1]
RUN_FILE = "uiface_long_run.json"  # in the workspace: how the run went (wall and stage seconds, commit)


def record(ws: Path, run: dict[str, Any]) -> dict[str, Any]:
    """Write ``RUN_FILE`` in ``ws`` for a finished run: ``run`` has its ``wall_s`` and ``stage_s``."""
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ws, capture_output=True,
                            text=True).stdout.strip()
    run = {"preset": PRESET, "commit": commit, "minutes": round(run["wall_s"] / 60, 1), **run, **machine_facts()}
    write_json(ws / RUN_FILE, run)
    return run


def run_preset(ws: Path) -> dict[str, Any]:
    """Clone this checkout into ``ws`` unless it exists, install it and time ``faceops run --preset uiface-long``."""
    if not ws.exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(ws)], check=True)
    timed_run(ws, ("make", "setup"), log="setup.log")
    return record(ws, timed_run(ws, (str(ws / ".venv" / "bin" / "faceops"), "run", "--preset", PRESET),
                                log="uiface_long.log"))


def read_run(root: Path) -> dict[str, Any]:
    """The metrics a run's targets read (``metrics/synthesize.json``, ``evaluate.json``, ``train_generator.json``)
    and its FR models' configs (Table 3's budgets)."""
    models = {p.parent.name: json.loads(p.read_text()) for p in sorted((root / "models" / "fr").glob("*/config.json"))}
    return {**{n: read_stage_metrics(root, n) for n in ("synthesize", "evaluate", "train_generator")}, "models": models}


DENOISE_T = (20, 60, 140, 300, 500)  # timesteps of the one-step denoising profile: the last DDIM steps to mid-way


def denoising_profile(model: Any, x0: Any, context: Any, schedule: dict[str, Any], timesteps=DENOISE_T,
                      seed: int = 0) -> list[dict[str, float]]:
    """How well the UNet removes noise in one step, per timestep t: faces ``x0`` (B, C, H, W) in the UNet's layout
    are noised to x_t with their ``context`` (B, tokens, dim) and ε̂ is read off the output (``epsilon_from``).
    Per t: σ_t, the cosine of ε̂ with the true ε and their norm ratio (below 1: the UNet leaves part of the noise in),
    and the mean square error of x̂_0 = (x_t − √(1 − ᾱ)·ε̂)/√ᾱ against that of x_t/√ᾱ (no denoising at all)."""
    import torch

    from ml.generator.sampler import epsilon_from
    from ml.generator.train import make_noise_scheduler

    scheduler = make_noise_scheduler(schedule)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for t in timesteps:
        eps = torch.randn(x0.shape, generator=gen)
        tt = torch.full((len(x0),), int(t))
        x_t = scheduler.add_noise(x0, eps, tt)
        abar = scheduler.alphas_cumprod[int(t)].double()
        with torch.no_grad():
            out = model(x_t, tt, context)
        e = epsilon_from(out.double(), x_t.double(), abar, schedule.get("prediction_type", "epsilon"))
        x0_hat = (x_t.double() - (1 - abar).sqrt() * e) / abar.sqrt()
        rows.append({"t": int(t), "sigma": float(((1 - abar) / abar).sqrt()),
                     "eps_cosine": float(torch.nn.functional.cosine_similarity(e.flatten(1), eps.double().flatten(1))
                                         .mean()),
                     "eps_norm_ratio": float(e.norm() / eps.double().norm()),
                     "x0_mse": float((x0_hat - x0.double()).pow(2).mean()),
                     "undenoised_mse": float((x_t.double() / abar.sqrt() - x0.double()).pow(2).mean())})
    return rows


def denoising(ws: Path, faces: int = 64, model_dir: Path | None = None) -> list[dict[str, float]]:
    """``denoising_profile`` of the pixel-space generator in ``model_dir`` (default: ``ws``'s) on the first ``faces``
    val faces of ``ws``'s training identities, each with its own FR context (empty for a latent generator: its faces
    are not the UNet's input)."""
    import torch

    from ml.data.dataset import load_images, read_manifest
    from ml.generator.train import images_to_unit_range
    from ml.models.io import read_model_config
    from tasks.synthesize import load_generator_for
    from tasks.train_generator import identity_embeddings, load_fr, resize_faces

    paths = Paths(ws)
    model_dir = model_dir or paths.generator_model
    if read_model_config(model_dir, what="UIFace generator").get("extra", {}).get("space") != "pixel":
        return []
    model, extra, _ = load_generator_for(paths, None, model_dir)
    rows = read_manifest(paths.train_set / "manifest.parquet")
    val = rows[rows["split"] == "val"].head(faces).reset_index(drop=True)
    images = resize_faces(load_images(paths.train_set, val), int(extra["context_size"]))
    fr, _, _ = load_fr(paths, Path(extra["fr_model"]).name, "generator.fr_source")
    context = model.encode_context(torch.as_tensor(identity_embeddings(fr, images, None), dtype=torch.float32))
    x0 = model.to_unet(images_to_unit_range(torch.from_numpy(images).permute(0, 3, 1, 2)))
    return denoising_profile(model, x0, context, extra["noise_schedule"])


def targets(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{target: {"value", "goal", "unit", "sense", "met"}} for each target of ``TARGETS`` the run has inputs for."""
    out = {}
    for what, value, _, goal, unit, sense in TARGETS:
        try:
            v = float(value(run["synthesize"], run["evaluate"], run["train_generator"]))
        except KeyError:
            continue
        out[what] = {"value": v, "goal": goal, "unit": unit, "sense": sense,
                     "met": v >= goal if sense == "≥" else v <= goal}
    return out


def profile_lines(profile: list[dict[str, float]]) -> list[str]:
    """Markdown for ``denoising_profile``'s rows (nothing when there are none)."""
    if not profile:
        return []
    return ["", "## Where its faces' grain comes from: one denoising step of the long run's UNet", "",
            "`denoising_profile`: 64 val faces of training identities, each with its own context, noised to x_t and "
            "denoised once. A norm ratio below 1 is noise the UNet leaves in; DDIM's last steps (t ≤ 40 of 25 "
            "steps) hand that remainder to the faces. Scored on: val faces.", "",
            "| t | σ_t | cos(ε̂, ε) | ‖ε̂‖ / ‖ε‖ | MSE of x̂_0 | MSE without denoising |", "|---|---|---|---|---|---|",
            *(f"| {r['t']} | {r['sigma']:.3f} | {r['eps_cosine']:.3f} | {r['eps_norm_ratio']:.3f} | {r['x0_mse']:.4f} "
              f"| {r['undenoised_mse']:.4f} |" for r in profile)]


def render(default: dict[str, dict[str, Any]], long: dict[str, dict[str, Any]], run: dict[str, Any],
           section: list[str], profile: list[dict[str, float]] = ()) -> str:
    """The report: both runs' targets side by side, the long run's UIFace section, its denoising profile."""
    cell = lambda t: "—" if t is None else f"{t['value']:.1f} {t['unit']}" + ("" if t["met"] else " (missed)")  # noqa: E731
    stages = run["stage_s"]
    lines = [f"# UIFace with time: `--preset {PRESET}` beside the default run", "",
             f"`python -m experiments.uiface_long --workspace DIR`: `faceops run --preset {PRESET}` on a fresh clone "
             f"of {run['commit']} ({run['cpu']}, {run['cores']} cores, bf16 {run['cpu_has_bf16']}, AMX "
             f"{run['cpu_has_amx']}), beside the default run's committed metrics. The preset is the pixel-space "
             "design (`reports/generator_designs.md`: no decoder bounds its faces) with five times `uiface-pixel`'s "
             "UNet steps; every other stage as the default run. Chosen on: nothing (each generator keeps its last "
             "epoch). Scored on: each run's own samples, judges and held-out verification pairs.", "",
             f"The run took {run['minutes']:.1f} min wall (installing not included), `train_generator` "
             f"{stages.get('train_generator', float('nan')):.0f} s and `synthesize` "
             f"{stages.get('synthesize', float('nan')):.0f} s.", "",
             "| target | goal | default run | `uiface-long` |", "|---|---|---|---|"]
    for what in dict.fromkeys([*default, *long]):
        t = long.get(what) or default[what]
        lines.append(f"| {what} | {t['sense']} {t['goal']:g} {t['unit']} | {cell(default.get(what))} | "
                     f"{cell(long.get(what))} |")
    lines += ["", f"## The `{PRESET}` run's synthetic data, as its own report renders it", *section[3:],
              *profile_lines(list(profile))]
    return "\n".join(lines).replace("../plots/synthetic_samples.png", "uiface_long/synthetic_samples.png") + "\n"


def write(ws: Path, out_root: Path = ROOT) -> str:
    """Render the report for the finished run in ``ws`` against ``out_root``'s default run; write it there."""
    run = json.loads((ws / RUN_FILE).read_text())
    long, default = read_run(ws), read_run(out_root)
    section = synthetic_section(long["synthesize"], long["evaluate"], long["models"], long["train_generator"])
    profile = denoising(ws) if (Paths(ws).generator_model / "config.json").is_file() else []
    text = render(targets(default), targets(long), run, section, profile)
    picture = out_root / "reports" / "uiface_long" / "synthetic_samples.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Paths(ws).plots / "synthetic_samples.png", picture)
    write_json(out_root / "metrics" / "uiface_long.json", {"run": run, "default": targets(default),
                                                           "uiface_long": targets(long), "denoising": profile})
    write_text(out_root / "reports" / "uiface_long.md", text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Runs about two hours on 2 cores; nothing else should run beside it.")
    parser.add_argument("--workspace", type=Path, required=True, help="where the run is made (a clone of this "
                        "checkout is made there if it does not exist), or was made (with --log)")
    parser.add_argument("--log", type=Path, help="record a run already made in --workspace: its `faceops run` output")
    parser.add_argument("--wall-seconds", type=float, help="with --log: the run's wall time")
    args = parser.parse_args(argv)
    if args.log is not None:
        if args.wall_seconds is None:
            parser.error("--log needs --wall-seconds (the run's wall time)")
        record(args.workspace, {"wall_s": round(args.wall_seconds, 1), "stage_s": stage_seconds(args.log.read_text())})
    elif not (args.workspace / RUN_FILE).is_file():
        run_preset(args.workspace)
    print(write(args.workspace))


if __name__ == "__main__":
    main()
