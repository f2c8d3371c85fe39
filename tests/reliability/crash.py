"""Crash-and-resume worker and driver for the four trainers (FR, UIFace generator, CAFace fusion, FaceGCD discovery).

Run as a worker::

    python -m tests.reliability.crash <trainer> <checkpoint_dir> <out.json> [--resume] [--hold-at K] [--die-in-save N]

it trains ``<trainer>`` at toy size (tiny model, tiny separable data, CPU, one thread, seeded), with
``checkpoint_dir`` as the trainer's checkpoint directory, and writes its final metrics to ``out.json`` (per-epoch
losses, a digest of the final weights) and the final weights to ``out.pt``, both by temp file + rename. On stdout
it announces ``faceops-crash resumed-from <epoch>`` once and ``faceops-crash step <global step>`` after every
optimiser step (a global ``torch.optim`` step hook, so the trainers need no hooks of their own).

Two ways to die, both a real SIGKILL that no handler can intercept:

- ``--hold-at K``: after global step K the worker announces the step and waits; the driver sees the line and
  SIGKILLs it. The kill lands after a known step, whatever the trainer had written to disk by then.
- ``--die-in-save N``: the worker SIGKILLs itself in the middle of writing its N-th checkpoint (every trainer is a
  Lightning fit: the bytes written to fsspec's temporary file, closed but not yet moved onto ``last.ckpt``; a
  direct ``torch.save`` to a file, should a trainer do one, dies with half of its bytes written).

The driver (``kill_and_resume``) picks the kill step with a seeded RNG, starts the worker, kills it, then resumes
in a fresh process until training completes; ``reference`` runs the same training uninterrupted in-process.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
PREFIX = "faceops-crash"
HOLD_SECONDS = 600.0  # a held worker whose driver vanished exits after this instead of lingering


# ------------------------------------------------------------------------------------------------- toy trainers
@dataclass(frozen=True)
class Spec:
    """One trainer at toy size: its checkpoint file name, epochs × steps per epoch, and the tolerance its resume
    promises on the weights (0.0: bit-identical; all four document that a resumed run equals an uninterrupted one,
    and on one CPU thread it does to the bit)."""

    name: str
    checkpoint: str
    epochs: int
    steps_per_epoch: int
    tolerance: float
    train: Callable[[Path | None, bool], tuple[dict[str, Any], dict[str, Any]]] = field(repr=False)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def _separable(k: int, per_class: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class its own coarse colour pattern plus pixel noise → (uint8 images (N, S, S, 3), labels (N,))."""
    from tests.conftest import separable

    return separable(k, per_class, size=size, seed=seed)


def _train_fr(checkpoint_dir: Path | None, resume: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A one-block ViT with PartialFC + LVFace and token masking (the model's own randomness must resume too):
    16 identities × 4 images, batches of 8 → 8 steps per epoch, 3 epochs."""
    from ml.fr.train import FRConfig, train_fr

    cfg = FRConfig(epochs=3, batch_size=8, lr=2e-3, embedding_dim=32, accelerator="cpu", warmup_epochs=1.0,
                   augment_recipe="kprpe", sample_rate=0.5, lvface=True, grad_clip=5.0)
    images, labels = _separable(16, 4, 32, 0)
    result = train_fr(cfg, images, labels, progress=False, backbone_overrides={"depth": 1, "mask_ratio": 0.25},
                   checkpoint_dir=checkpoint_dir, resume=resume)
    return result.model.state_dict(), {"losses": [row["train/loss"] for row in result.history]}


def _train_generator(checkpoint_dir: Path | None, resume: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A 2-level UNet (8/16 channels) on 16 px images with FR-like embeddings: 32 images, batches of 8 → 4 steps
    per epoch, 3 epochs. The weights compared are the EMA ones (what is saved)."""
    from ml.generator.uiface import GeneratorModelConfig
    from ml.generator.train import GeneratorConfig, train_generator

    model = GeneratorModelConfig(image_size=16, block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4,
                                 context_dim=16)
    cfg = GeneratorConfig(model=model, batch_size=8, epochs=3, lr=2e-3, accelerator="cpu", seed=0)
    images, labels = _separable(4, 8, 16, 0)
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(4, 512))
    ids = (centres[labels] + 0.3 * rng.normal(size=(len(labels), 512))).astype(np.float32)
    result = train_generator(cfg, images, ids, checkpoint_dir=checkpoint_dir, resume=resume, progress=False)
    state = {**result.model.state_dict(), **{f"raw.{k}": v for k, v in result.raw_model.state_dict().items()}}
    return state, {"losses": [row["train/loss"] for row in result.history]}


def _train_fusion(checkpoint_dir: Path | None, resume: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """CAFace on 16 identities: sets of 4, 4 identities per step, 4 steps per epoch, 4 epochs (LR step at 3)."""
    from ml.fusion.train import FusionConfig, train_fusion
    from tests.conftest import caface_toy

    cfg = FusionConfig(feature_dim=32, style_dim=8, epochs=4, steps_per_epoch=4, lr=3e-3, per_identity=8, group=4,
                       min_len=4, max_len=4, batch_size=4, lr_steps=(3,), accelerator="cpu")
    feats, styles, labels, _ = caface_toy(k=16, per=8)
    result = train_fusion(cfg, feats, styles, labels, checkpoint_dir=checkpoint_dir, resume=resume, progress=False)
    return result.model.state_dict(), {"losses": [row["train/loss"] for row in result.history]}


def _train_discovery(checkpoint_dir: Path | None, resume: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """FaceGCD from a seeded two-block ViT saved as the FR model, random base prefix (the model's own RNG must
    resume too): 32 images, batches of 16 → 2 steps per epoch, 4 epochs."""
    import torch

    from ml.fr.backbones.vit import vit_tiny
    from ml.models.io import save_model
    from ml.discovery.train import DiscoveryConfig, train_discovery

    vit_kwargs = dict(img_size=32, patch_size=8, dim=32, depth=2, heads=2, embed_dim=16, drop_path=0.0)
    cfg = DiscoveryConfig(backbone_init="fr", prefix_length=3, warmup_epochs=0.0, batch_size=16, lr=2e-3, epochs=4,
                          learn_base_prefix=False, proj_dim=32, proj_hidden=64, proj_bottleneck=16)
    images, labels = _separable(4, 8, 32, 1)
    # beside the checkpoints (the test's own tmp_path) when there are any: a killed worker cannot clean up
    scratch = checkpoint_dir.parent if checkpoint_dir is not None else None
    with tempfile.TemporaryDirectory(prefix="faceops-crash-fr-", dir=scratch) as tmp:
        torch.manual_seed(0)
        save_model(Path(tmp) / "fr", vit_tiny(**vit_kwargs).eval(), backbone="vit_tiny", kwargs=vit_kwargs)
        result = train_discovery(cfg, images, labels, labels < 2, init_model_dir=Path(tmp) / "fr",
                                 checkpoint_dir=checkpoint_dir, resume=resume, progress=False)
    return result.model.state_dict(), {"losses": [row["loss"] for row in result.history]}


SPECS: dict[str, Spec] = {
    "fr": Spec("fr", "last.ckpt", 3, 8, 0.0, _train_fr),
    "generator": Spec("generator", "last.ckpt", 3, 4, 0.0, _train_generator),
    "fusion": Spec("fusion", "last.ckpt", 4, 4, 0.0, _train_fusion),
    "discovery": Spec("discovery", "last.ckpt", 4, 2, 0.0, _train_discovery),
}


# ------------------------------------------------------------------------------------------------- the worker
def checkpoint_epoch(path: Path) -> int:
    """Epochs completed in checkpoint ``path`` (0 when it does not exist). Lightning stores the index of the epoch
    it saved in (``epoch``, 0-based); the plain trainers store epochs completed."""
    import torch

    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=False)
    return int(state["epoch"]) + 1 if path.suffix == ".ckpt" else int(state["epoch"])


def weights_digest(state: dict[str, Any]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in key order: equal digests ⇔ identical weights."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _announce(*words: Any) -> None:
    print(PREFIX, *words, flush=True)


def _install_step_hook(offset: int, hold_at: int | None) -> None:
    """Announce the global step after every optimiser step; at ``hold_at`` wait to be killed."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count = {"steps": offset}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        count["steps"] += 1
        _announce("step", count["steps"])
        if hold_at is not None and count["steps"] == hold_at:
            time.sleep(HOLD_SECONDS)
            sys.exit(f"{PREFIX}: held at step {hold_at} for {HOLD_SECONDS:.0f} s and nobody killed this worker")

    register_optimizer_step_post_hook(hook)


def _die_in_save(nth: int) -> None:
    """SIGKILL this process half-way through writing its ``nth`` checkpoint (see the module docstring)."""
    import fsspec.implementations.local as fs_local
    import torch

    saves = {"n": 0}
    real_save, real_commit = torch.save, fs_local.LocalFileOpener.commit

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, io.BytesIO):  # Lightning serialises to memory first, then writes through fsspec
            return real_save(obj, f, *args, **kwargs)
        saves["n"] += 1
        if saves["n"] < nth:
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def commit(self: Any) -> None:
        saves["n"] += 1
        if saves["n"] >= nth:  # the file is written and closed, not yet moved onto the checkpoint's name
            os.kill(os.getpid(), signal.SIGKILL)
        real_commit(self)

    torch.save = save
    fs_local.LocalFileOpener.commit = commit


def _write_atomically(path: Path, write: Callable[[Any], None], mode: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_training(trainer: str, checkpoint_dir: Path | None, resume: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train ``trainer`` at toy size on one CPU thread → (final weights, metrics)."""
    import torch

    spec = SPECS[trainer]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state, metrics = spec.train(checkpoint_dir, resume)
    finally:
        torch.set_num_threads(before)
    state = {k: v.detach().cpu().clone() for k, v in state.items()}
    metrics.update(trainer=trainer, final_loss=metrics["losses"][-1], epochs=len(metrics["losses"]),
                   digest=weights_digest(state))
    return state, metrics


def worker(argv: list[str] | None = None) -> None:
    """The command line: train, announce progress, write ``out.json`` and ``out.pt``."""
    import torch

    parser = argparse.ArgumentParser(prog="python -m tests.reliability.crash", description=__doc__.split("\n")[0])
    parser.add_argument("trainer", choices=sorted(SPECS))
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-at", type=int, default=None, help="wait to be killed after this global step")
    parser.add_argument("--die-in-save", type=int, default=None, help="SIGKILL itself inside this checkpoint write")
    args = parser.parse_args(argv)
    spec = SPECS[args.trainer]
    start_epoch = checkpoint_epoch(args.checkpoint_dir / spec.checkpoint) if args.resume else 0
    _announce("resumed-from", start_epoch)
    _install_step_hook(start_epoch * spec.steps_per_epoch, args.hold_at)
    if args.die_in_save is not None:
        _die_in_save(args.die_in_save)
    state, metrics = run_training(args.trainer, args.checkpoint_dir, args.resume)
    metrics["resumed_from_epoch"] = start_epoch
    _write_atomically(args.out.with_suffix(".pt"), lambda fh: torch.save(state, fh), "wb")
    _write_atomically(args.out, lambda fh: fh.write(json.dumps(metrics, indent=2) + "\n"), "w")
    _announce("done")


# ------------------------------------------------------------------------------------------------- the driver
@dataclass
class Attempt:
    """One worker process: how it ended and what it announced."""

    returncode: int
    resumed_from: int
    last_step: int
    stderr: str


@dataclass
class CrashRun:
    """A kill/resume sequence and its outcome."""

    trainer: str
    kill_step: int  # global step after which the held worker was SIGKILLed
    die_in_save: int  # the earlier worker died inside this checkpoint write (1-based, in that process)
    attempts: list[Attempt]
    metrics: dict[str, Any]  # the final (resumed) worker's out.json
    state: dict[str, Any]  # its final weights
    checkpoint_dir: Path


def _worker_env() -> dict[str, str]:
    """One thread everywhere, quiet, offline; the repository importable as the working directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    return env


def launch(trainer: str, checkpoint_dir: Path, out: Path, *, resume: bool, hold_at: int | None = None,
           die_in_save: int | None = None, timeout: float = 300.0) -> Attempt:
    """Run one worker; with ``hold_at`` SIGKILL it as soon as it announces that step. → how it ended."""
    cmd = [sys.executable, "-m", "tests.reliability.crash", trainer, str(checkpoint_dir), str(out)]
    cmd += ["--resume"] * resume
    cmd += ["--hold-at", str(hold_at)] * (hold_at is not None)
    cmd += ["--die-in-save", str(die_in_save)] * (die_in_save is not None)
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_worker_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)
    resumed_from, last_step = -1, 0
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            words = line.split()
            if words[:2] == [PREFIX, "resumed-from"]:
                resumed_from = int(words[2])
            elif words[:2] == [PREFIX, "step"]:
                last_step = int(words[2])
                if hold_at is not None and last_step == hold_at:
                    os.killpg(proc.pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise TimeoutError(f"{trainer} worker ran past {timeout:.0f} s: {' '.join(cmd)}")
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err.seek(0)
        stderr = err.read()
        err.close()
    return Attempt(proc.returncode, resumed_from, last_step, stderr)


def _expect(attempt: Attempt, returncode: int, what: str) -> None:
    if attempt.returncode != returncode:
        raise AssertionError(f"{what}: exit status {attempt.returncode}, expected {returncode}; stderr tail:\n"
                             f"{attempt.stderr[-3000:]}")


def kill_and_resume(trainer: str, workdir: Path, seed: int | str) -> CrashRun:
    """Die inside a random checkpoint write, then resume and get SIGKILLed after a random later step, then resume
    to the end in a fresh process. The random choices come from ``random.Random(seed)``."""
    import torch

    spec = SPECS[trainer]
    rng = random.Random(f"{trainer}:{seed}")
    die_in_save = rng.randint(1, spec.epochs - 1)  # checkpoints die_in_save - 1 complete ones survive
    survived = die_in_save - 1
    kill_step = rng.randint(survived * spec.steps_per_epoch + 1, spec.total_steps - 1)
    ckpt, out = workdir / "ckpt", workdir / "out.json"
    ckpt.mkdir(parents=True)  # a fresh directory: the first worker must not find an old checkpoint
    attempts = [launch(trainer, ckpt, out, resume=False, die_in_save=die_in_save)]
    _expect(attempts[-1], -signal.SIGKILL, f"{trainer} worker dying in checkpoint write {die_in_save}")
    attempts.append(launch(trainer, ckpt, out, resume=True, hold_at=kill_step))
    _expect(attempts[-1], -signal.SIGKILL, f"{trainer} worker held at step {kill_step}")
    attempts.append(launch(trainer, ckpt, out, resume=True))
    _expect(attempts[-1], 0, f"{trainer} worker resuming after the kill at step {kill_step}")
    metrics = json.loads(out.read_text())
    state = torch.load(out.with_suffix(".pt"), map_location="cpu", weights_only=True)
    return CrashRun(trainer, kill_step, die_in_save, attempts, metrics, state, ckpt)


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a − b| over all tensors of two state dicts with the same keys and shapes."""
    if a.keys() != b.keys():
        raise AssertionError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))[:10]}")
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        if x.shape != y.shape:
            raise AssertionError(f"{key}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        if x.numel():
            worst = max(worst, float((x - y).abs().max()))
    return worst


def reference(trainer: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same toy training uninterrupted, in this process, without checkpoints."""
    return run_training(trainer, None, False)


if __name__ == "__main__":
    worker()
