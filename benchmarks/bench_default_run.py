"""The default run as a user gets it: ``make run`` from a fresh clone of this commit, timed, and compared with a
second fresh-clone run made while other work loads every core.

- ``make_run``: wall time (installing included), CPU time of everything it started, each stage's seconds as the
  command's summary prints them, the machine facts that decide the run's numerics (cores, AMX), and a fixed
  workload's seconds before and after (``speed_probe``): a shared host's speed drifts over hours, and a row taken
  on a slow hour says so.
- ``reproducibility``: a second fresh clone runs ``make run`` beside other work (a busy process per core, or the
  command ``FACEOPS_BENCH_BESIDE`` names, e.g. another clone's ``.ci/run``); its ``metrics/*.json`` (wall-clock keys
  aside) and the output hashes in ``dvc.lock`` are compared with the first run's: ``make_run``'s clone (kept under
  ``$FACEOPS_BENCH_RUNS``, by default ``faceops-bench-runs`` in the temporary directory) when its pipeline is HEAD's.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# the fresh clones, outside the repository (a clone inside it would be one more dvc.yaml in DVC's tree)
RUNS = Path(os.environ.get("FACEOPS_BENCH_RUNS") or Path(tempfile.gettempdir()) / "faceops-bench-runs")
TIME_KEYS = ("seconds", "per_s", "throughput", "elapsed")  # wall-clock metric keys, as the reproducibility test has
STAGE_LINE = re.compile(r"^\s+(\S+)\s+(ran|restored|up to date)\s+([\d.]+)s$")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def _clone(dst: Path, commit: str) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(dst)], check=True)
    subprocess.run(["git", "checkout", "-q", commit], cwd=dst, check=True)
    return dst


def stage_seconds(stdout: str) -> dict[str, float]:
    """Each stage's seconds from ``faceops run``'s closing summary table."""
    return {m[1]: float(m[3]) for m in map(STAGE_LINE.match, stdout.splitlines()) if m}


def timed_run(root: Path, command: tuple[str, ...] = ("make", "run"), log: str = "make_run.log") -> dict:
    """``command`` (default ``make run``) in ``root``, its output in ``root/log``: wall and CPU seconds, each
    stage's seconds from the summary table; RuntimeError naming the log when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "MLFLOW_", "PREFECT_API"))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(list(command), cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (root / log).write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {root} (exit {out.returncode}); log: {root / log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "minutes": round(wall / 60, 1), "core_s": round(cpu, 1),
            "stage_s": stage_seconds(out.stdout)}


def machine_facts() -> dict:
    from faceops.doctor import _cpu_name
    from ml.train.device import available_cores, cpu_has_amx, cpu_has_bf16

    return {"cpu": _cpu_name(), "cores": available_cores(), "cpu_has_bf16": cpu_has_bf16(),
            "cpu_has_amx": cpu_has_amx()}


# a fixed one-thread workload (float32 matmuls, a bfloat16-autocast convolution step): its seconds say how fast this
# machine ran around a measurement, so that rows taken on a slow hour of a shared host can be told apart
PROBE = """
import time, torch
torch.manual_seed(0); torch.set_num_threads(1)
a = torch.randn(512, 512); x = torch.randn(64, 3, 32, 32); conv = torch.nn.Conv2d(3, 64, 3, padding=1)
def work():
    for _ in range(100): a @ a
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(10): conv(x).float().sum().backward()
work()
best = float("inf")
for _ in range(3):
    start = time.perf_counter()
    for _ in range(5): work()
    best = min(best, time.perf_counter() - start)
print(best)
"""


def speed_probe() -> float:
    """Seconds of ``PROBE``'s workload (best of 3), in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return round(float(out.stdout.split()[-1]), 2)


def bench_make_run() -> dict:
    """``make run`` from a fresh clone of HEAD with nothing else running (the workspace is kept for
    ``bench_reproducibility``), between two speed probes."""
    commit = _head()  # what the clone checks out: HEAD may move while the run takes its minutes
    root = _clone(RUNS / "alone", commit)
    before = speed_probe()
    run = timed_run(root)
    return {"commit": commit[:12], **run, "probe_s_before": before, "probe_s_after": speed_probe(), **machine_facts()}


# what a default run's outputs depend on: a clone of another commit that differs only elsewhere is the same run
PIPELINE_PATHS = ("ml", "tasks", "flows", "ops", "faceops", "dvc.yaml", "params.yaml", "presets.yaml",
                  "pyproject.toml", "Makefile")


def _same_pipeline(root: Path) -> bool:
    """Whether the clone in ``root`` holds the pipeline of HEAD (its commit differs from HEAD only outside
    ``PIPELINE_PATHS``)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    return subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", *PIPELINE_PATHS], cwd=REPO).returncode == 0


def _hog(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x = (x * 31 + 7) % 1_000_003


def _untimed(tree: dict) -> dict:
    """Every metric of a nested ``metrics/*.json`` (keys joined with ``/``) but the wall-clock ones."""
    from flows.stages import flat_items

    return {k: v for k, v in flat_items(tree, "/").items() if not any(t in k for t in TIME_KEYS)}


def compare_runs(a: Path, b: Path) -> dict:
    """What differs between two finished workspaces: metric values (wall-clock keys aside) over every
    ``metrics/*.json``, and the output hashes ``dvc.lock`` records, models and datasets apart."""
    values = differ = 0
    for path in sorted((a / "metrics").glob("*.json")):
        ma, mb = (_untimed(json.loads(p.read_text())) for p in (path, b / "metrics" / path.name))
        values += len(ma)
        differ += sum(ma.get(k) != mb.get(k) for k in set(ma) | set(mb))

    def outs(root: Path) -> dict[str, str]:
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        return {o["path"]: o["md5"] for e in lock.values() for o in e.get("outs", [])}

    oa, ob = outs(a), outs(b)
    models = [p for p in oa if p.startswith(("models/", "data/"))]
    return {"metric_values": values, "metric_values_differing": differ, "models_and_datasets": len(models),
            "models_and_datasets_differing": sorted(p for p in models if oa[p] != ob.get(p))}


def bench_reproducibility() -> dict:
    """A second fresh-clone ``make run`` beside other work, compared with one made alone: beside a busy process per
    core, or beside the command ``FACEOPS_BENCH_BESIDE`` names (e.g. the test suite of another clone), whose exit
    status is recorded too."""
    alone = RUNS / "alone"
    if not (alone / "dvc.lock").is_file() or not _same_pipeline(alone):
        bench_make_run()
    commit = _head()
    loaded = _clone(RUNS / "loaded", commit)
    command = os.environ.get("FACEOPS_BENCH_BESIDE", "").strip()
    beside: dict = {}
    if command:
        start = time.perf_counter()
        job = subprocess.Popen(command, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run = timed_run(loaded)
        beside = {"beside": command, "beside_exit": job.wait(), "beside_minutes": round((time.perf_counter() - start)
                                                                                        / 60, 1)}
    else:
        cores = os.cpu_count() or 1
        ctx = multiprocessing.get_context("spawn")
        hogs = [ctx.Process(target=_hog, args=(6 * 3600,), daemon=True) for _ in range(cores)]
        for h in hogs:
            h.start()
        try:
            run = timed_run(loaded)
        finally:
            for h in hogs:
                h.terminate()
        beside = {"beside": f"{cores} busy processes"}
    return {"commit": commit[:12], "loaded_minutes": run["minutes"], **beside, **compare_runs(alone, loaded),
            **machine_facts()}
