"""Shared fixtures. Tests run offline and quiet; the servers they start listen on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from faceops.workspace import copy_project as _copy_project

REPO = Path(__file__).resolve().parents[1]
GLINT24 = REPO.parent / "shared" / "data" / "glint24"

for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_k, _v)

# `make test` runs the files on two pytest-xdist workers (most tests wait on servers and subprocesses, not the CPU).
# Each worker gets its own Prefect home (the temporary servers' SQLite database) and Ray session folder, and one
# thread per torch / BLAS pool so that two workers' training does not oversubscribe the cores.
if _worker := os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _home = Path(tempfile.gettempdir()) / f"faceops-tests-{os.getpid()}-{_worker}"
    os.environ.setdefault("PREFECT_HOME", str(_home / "prefect"))
    os.environ.setdefault("RAY_TMPDIR", str(_home / "ray"))
    # made here: a temporary Prefect server opens its SQLite file in PREFECT_HOME without creating the folder, so a
    # worker whose first Prefect use is a flow run (not the CLI, which creates it) would fail to start one
    for _dir in (os.environ["PREFECT_HOME"], os.environ["RAY_TMPDIR"]):
        Path(_dir).mkdir(parents=True, exist_ok=True)
    for _k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_k, "1")

# DVC binds its console handlers to whatever sys.stdout / sys.stderr are when it is first imported. Imported here, that
# is pytest's session-long capture; imported first inside a test that uses capsys or capfd, it would be that test's
# buffer, closed when the test ends, and every later in-process DVC call in the worker would fail to log and stop.
import dvc  # noqa: E402, F401

# where the trainers' "it learns" tests train: the CPU in full precision unless FACEOPS_TEST_ACCELERATOR /
# FACEOPS_TEST_PRECISION say otherwise, so that the same assertions check a GPU worker in mixed precision
# (FACEOPS_TEST_ACCELERATOR=gpu FACEOPS_TEST_PRECISION=bf16-mixed pytest -k "learn or beats")
TRAIN_DEVICE = {"accelerator": os.environ.get("FACEOPS_TEST_ACCELERATOR", "cpu"),
                "precision": os.environ.get("FACEOPS_TEST_PRECISION", "32-true")}

EXIT_GRACE_S = 60  # after the summary, how long Prefect's client may still flush before the process exits anyway


def pytest_sessionfinish(session, exitstatus):
    session.config._faceops_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit at most ``EXIT_GRACE_S`` after the run. The tests start and stop many Prefect servers; at interpreter exit
    Prefect's client drains its log and event queues, without a time limit, to whichever server a flow run last
    talked to, and it retries each item against a server that is gone: that alone can outlast the whole CI budget.
    The results are already reported, so a watchdog ends the process with pytest's exit status."""
    import sys
    import threading
    import time

    if "prefect" not in sys.modules:
        return
    status = getattr(config, "_faceops_exitstatus", 0)

    def watchdog() -> None:
        import psutil

        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(f"\nPrefect's client was still flushing logs/events to stopped test servers {EXIT_GRACE_S} s "
                         f"after the run; exiting with pytest's status {status}\n")
        sys.stderr.flush()
        # os._exit skips atexit, where Prefect stops the temporary server a flow run without PREFECT_API_URL started
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def copy_project(dst: Path) -> Path:
    return _copy_project(REPO, dst)


def curve_problems(client, run_id: str) -> list[str]:
    """What is wrong with the metric histories of an MLflow run, as the UI's "Model metrics" charts draw them: per
    key, in the order logged, the steps must strictly increase, and no curve may start with its final value at
    step 0 (a summary logged without a step)."""
    problems = []
    for key in sorted(client.get_run(run_id).data.metrics):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)  # stable: logging order
        steps = [m.step for m in history]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            problems.append(f"{key}: steps {steps} do not strictly increase")
        by_step = sorted(history, key=lambda m: m.step)
        if len(by_step) > 1 and by_step[0].step == 0 and by_step[0].value == by_step[-1].value \
                and by_step[-1].step > 0 and any(m.value != by_step[0].value for m in by_step):
            problems.append(f"{key}: the final value {by_step[-1].value} is also at step 0")
    return problems


@pytest.fixture(autouse=True)
def _restore_sys_path():
    """Put ``sys.path`` back after each test. Loading a flow from its entrypoint (a deployment run in-process)
    puts the entrypoint's folder first, so ``flows/experiments.py`` would shadow the ``experiments`` package in
    every process spawned later (DataLoader workers, process pools re-import by module name)."""
    import sys

    before = list(sys.path)
    yield
    sys.path[:] = before




@pytest.fixture(autouse=True)
def _restore_tracking_uri():
    """Put MLflow's tracking URI back after each test. ``mlflow.set_tracking_uri`` (what a stage run in-process calls)
    also sets ``MLFLOW_TRACKING_URI`` in ``os.environ`` for its subprocesses, so a later test that starts ``faceops``
    with a copy of the environment would log to the earlier test's store instead of its own workspace's."""
    import sys

    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(before)  # None unsets the variable as well
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a whole test module, restored after it; opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``. The tensors in those tests are tiny: on a shared
    2-core machine OpenMP hand-offs, not arithmetic, dominate, and timings stay stable under load."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory) -> Path:
    """The documentation site, built once for the run as CI builds it (``mkdocs build --strict``, offline): the
    contract test that it builds and the browser tests that read it share this one build."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture
def glint24() -> Path:
    if not GLINT24.is_dir():
        pytest.skip(f"real faces not available at {GLINT24} (shared/data/glint24 is not shipped with the product)")
    return GLINT24


def separable(k: int = 4, per_class: int = 32, size: int = 32, seed: int = 0):
    """Each class: its own random low-frequency colour pattern plus pixel noise → (uint8 images, labels)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (k, 4, 4, 3)).astype(np.float32)
    protos = coarse.repeat(size // 4, axis=1).repeat(size // 4, axis=2)
    labels = np.repeat(np.arange(k), per_class)
    images = protos[labels] + rng.normal(0.0, 25.0, (len(labels), size, size, 3))
    return np.clip(images, 0, 255).astype(np.uint8), labels


def spread_caface(model):
    """A CAFace with non-trivial weights (Ws ≠ 0, spread norm statistics) so that the assignment really varies per
    item, in eval mode; the generator is seeded so every test sees the same weights."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.sim.style_weight.normal_(0.0, 1.0, generator=g)
        model.cn.query.weight.normal_(0.0, 0.3, generator=g)
        model.cn.key.weight.normal_(0.0, 0.3, generator=g)
        model.sim.norm_bn.running_mean.fill_(2.5)
        model.sim.norm_bn.running_var.fill_(0.8)
    return model.eval()


def tiny_unet():
    """A random 52k-parameter diffusers UNet2DConditionModel (8×8 input, two levels, cross-attention at 8×8 and 4×4,
    context width 16) with the query and key weights ×4 so that attention is far from uniform."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4,
    ).eval()
    with torch.no_grad():
        for module in unet.modules():
            if isinstance(module, Attention):
                module.to_q.weight.mul_(4.0)
                module.to_k.weight.mul_(4.0)
    return unet


def caface_toy(k: int = 48, per: int = 16, dim: int = 32, style_dim: int = 8, seed: int = 0):
    """Identity centres; half the images are good (little noise, norm ≈ 8, style channel 0 ≈ 2) and half bad
    (noise 10× larger, norm ≈ 3, style channel 0 ≈ 0). Returns features, styles, labels and the true centres."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    good = rng.random((k, per)) < 0.5
    noise = rng.normal(size=(k, per, dim)) / np.sqrt(dim)
    feats = centres[:, None, :] + noise * np.where(good, 0.3, 3.0)[..., None]
    scale = np.where(good, 8.0, 3.0)[..., None] * rng.uniform(0.8, 1.2, size=(k, per, 1))
    feats = feats / np.linalg.norm(feats, axis=-1, keepdims=True) * scale
    styles = rng.normal(size=(k, per, style_dim, 2)) * 0.1
    styles[..., 0, 0] += 2.0 * good
    labels = np.repeat(np.arange(k), per)
    return (feats.reshape(k * per, dim).astype(np.float32), styles.reshape(k * per, style_dim, 2).astype(np.float32),
            labels, centres.astype(np.float32))


def stop_after(epochs: int):
    """A Lightning callback that stops a run after ``epochs`` epochs, as a preempted job would be (its last
    checkpoint is then that epoch's)."""
    import lightning

    class StopAfter(lightning.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch + 1 >= epochs:
                trainer.should_stop = True

    return StopAfter()


def prepare_smoke(root: Path):
    """``prepare`` run at the smoke preset's size into ``root`` → (DataConfig, Paths)."""
    import yaml

    from ml.config import from_mapping
    from tasks import prepare
    from tasks.common import Paths
    from tasks.params import load_preset

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in load_preset("smoke", REPO).items():
        section, name = key.split(".", 1)
        params[section][name] = value
    data = from_mapping(prepare.DataConfig, params["data"], "data")
    paths = Paths(root)
    prepare.run(data, paths)
    return data, paths
