"""Throughput of the DFA aligner at the embedded default (``AlignerConfig()``: 96² input, batch 16 of 14 faces + 2
non-face crops), CPU: training images/s and inference images/s.

Training runs ``train_aligner`` for whole epochs on unaligned 128-px procedural crops (as the stage does) and
counts the crops of every step (faces and non-faces) over the time from on_train_start to on_train_end, so the
one-off set-up (resizing the crops, rendering the non-face crops, building the Trainer) is outside it. Inference
is ``DFA.predict`` (resize to 96², forward, mixer pooling, back to pixels) on the same crops in batches of 64,
the best of three rounds. Both are given per second of wall time and per second of process CPU time; on one
thread the CPU-time number does not drop when other processes share the machine, the wall-time one does.
"""

from __future__ import annotations

import dataclasses
import time

import lightning
import torch

from ml.data.unaligned import unaligned_faces
from ml.aligner.train import AlignerConfig, train_aligner


class TrainTimer(lightning.Callback):
    """Wall and CPU time from on_train_start to on_train_end, and the number of steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.wall_s = self.cpu_s = 0.0
        self._wall0 = self._cpu0 = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.wall_s, self.cpu_s = time.perf_counter() - self._wall0, time.process_time() - self._cpu0


def bench_aligner_throughput(
    identities: int = 40, per_identity: int = 8, epochs: int = 2, threads: int | None = 1, rounds: int = 3
) -> dict:
    """Train the default DFA for ``epochs`` epochs on ``identities × per_identity`` unaligned 128-px faces, then
    time ``predict`` on them; ``threads`` torch threads (None: torch's choice).

    Returns:
        ``{"train_images_per_s", "train_images_per_cpu_s", "train_step_ms", "train_steps", "infer_images_per_s",
        "infer_images_per_cpu_s", "input_size", "batch_size", "threads"}``.
    """
    images, landmarks, _ = unaligned_faces(identities, per_identity, size=128, seed=0, first_identity=50_000)
    cfg = dataclasses.replace(AlignerConfig(), epochs=epochs, accelerator="cpu")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        timer = TrainTimer()
        model = train_aligner(cfg, images, landmarks, progress=False, callbacks=[timer]).model
        faces_per_step = min(cfg.batch_size - cfg.nonfaces_per_batch, len(images)) + cfg.nonfaces_per_batch
        trained = timer.steps * faces_per_step
        model.predict(images[:64])  # warm-up
        best_wall = best_cpu = float("inf")
        for _ in range(rounds):
            wall0, cpu0 = time.perf_counter(), time.process_time()
            model.predict(images, batch_size=64)
            best_wall = min(best_wall, time.perf_counter() - wall0)
            best_cpu = min(best_cpu, time.process_time() - cpu0)
        return {
            "train_images_per_s": trained / timer.wall_s,
            "train_images_per_cpu_s": trained / timer.cpu_s,
            "train_step_ms": 1000.0 * timer.wall_s / max(timer.steps, 1),
            "train_steps": timer.steps,
            "infer_images_per_s": len(images) / best_wall,
            "infer_images_per_cpu_s": len(images) / best_cpu,
            "input_size": cfg.input_size,
            "batch_size": cfg.batch_size,
            "threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    import sys

    r = bench_aligner_throughput(threads=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(
        f"DFA {r['input_size']}², batch {r['batch_size']}, {r['threads']} thread(s): training "
        f"{r['train_images_per_s']:.0f} images/s ({r['train_images_per_cpu_s']:.0f} per CPU-second, "
        f"{r['train_step_ms']:.0f} ms/step over {r['train_steps']} steps); inference {r['infer_images_per_s']:.0f} "
        f"images/s ({r['infer_images_per_cpu_s']:.0f} per CPU-second)"
    )
