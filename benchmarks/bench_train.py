"""Training throughput of the embedded model, and the share of wall time spent outside the model step."""

from __future__ import annotations

import time

import lightning
import numpy as np
import torch

from ml.data.procedural import ProceduralFaces
from ml.train.augment import augment_kprpe
from ml.fr.train import FRConfig, augment_batch, train_fr


class _StepTimer(lightning.Callback):
    """Wall time of each on_train_batch_start → on_train_batch_end (augmentation, forward, backward, optimiser
    step) against on_train_start → on_train_end; the rest is data loading, logging and epoch bookkeeping."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.steps = 0
        self.total_s = 0.0
        self._t0 = self._start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s += time.perf_counter() - self._t0
        self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.total_s = time.perf_counter() - self._start


def _faces(identities: int, per_identity: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    gen = ProceduralFaces(seed=seed)
    images = np.stack([gen.sample(i, j).image for i in range(identities) for j in range(per_identity)])
    return images, np.repeat(np.arange(identities), per_identity)


def bench_train_throughput(
    identities: int = 100,
    per_identity: int = 10,
    epochs: int = 2,
    batch_size: int = 128,
    recipe: str = "kprpe",
    threads: int | None = None,
) -> dict:
    """Train the embedded ``vit_tiny`` on 64×64 procedural faces (``identities × per_identity`` images) for
    ``epochs`` epochs on the CPU with the ``recipe`` augmentation, on ``threads`` torch threads (default:
    torch's choice). Target: outside_step_fraction ≤ 0.10.

    Returns:
        ``{"images_per_s"`` (trained images / time inside on_train_start→end), ``"outside_step_fraction"``,
        ``"augment_fraction"`` (the augmentation alone, re-timed on the same batches, inside the step share),
        ``"step_ms"``, ``"steps"``, ``"train_call_s"`` (the whole ``train_fr()`` call), ``"threads"}``.
    """
    images, labels = _faces(identities, per_identity)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(images, labels, epochs, batch_size, recipe)
    finally:
        torch.set_num_threads(previous)


def _measure(images: np.ndarray, labels: np.ndarray, epochs: int, batch_size: int, recipe: str) -> dict:
    cfg = FRConfig(epochs=epochs, batch_size=batch_size, accelerator="cpu", augment_recipe=recipe)
    timer = _StepTimer()
    result = train_fr(cfg, images, labels, callbacks=[timer], progress=False)
    trained = timer.steps * batch_size

    # The augmentation alone, on a batch of the same size, as FRModule runs it.
    x = torch.from_numpy(images[:batch_size]).permute(0, 3, 1, 2).contiguous()
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(timer.steps):
        if recipe == "kprpe":
            augment_kprpe(x.float() / 255.0, None, cfg.augmentation, generator=gen)
        else:
            augment_batch((x.float() / 255.0 - 0.5) / 0.5, generator=gen)
    augment_s = time.perf_counter() - start
    return {
        "images_per_s": trained / timer.total_s,
        "outside_step_fraction": 1.0 - timer.step_s / timer.total_s,
        "augment_fraction": augment_s / timer.total_s,
        "step_ms": 1000.0 * timer.step_s / max(timer.steps, 1),
        "steps": timer.steps,
        "train_call_s": result.seconds,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    import sys

    r = bench_train_throughput(threads=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(
        f"vit_tiny 64×64, {r['steps']} steps: {r['images_per_s']:.0f} images/s, outside the step "
        f"{100 * r['outside_step_fraction']:.1f} % (target ≤ 10 %), "
        f"augmentation {100 * r['augment_fraction']:.1f} %, "
        f"{r['step_ms']:.0f} ms/step, {r['threads']} threads"
    )
