"""PartialFC: two gloo ranks match a single-process full softmax exactly (also under the LVFace schedule);
sampling keeps every positive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ml.errors import ConfigError, DataError
from ml.fr.losses import ARCFACE, CombinedMarginLoss, LVFaceSchedule, PartialFC, distributed_cross_entropy, shard_bounds

DIM = 16
# (num_classes, batch sizes per rank): an even split and an uneven one (classes 7 = 3 + 4, batch 3 + 2)
CASES = [(8, (4, 4)), (7, (3, 2))]


def make_case(num_classes: int, sizes: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    return {
        "weight": torch.randn(num_classes, DIM, generator=g),
        "x": torch.randn(n, DIM, generator=g) * 3.0,
        # every class appears in the global batch of the even case; rows of rank 0 target rank 1's classes too
        "labels": torch.randperm(num_classes, generator=g).repeat(2)[:n],
    }


def reference(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-process full softmax: loss, d/dx, d/dW."""
    head = CombinedMarginLoss(DIM, case["weight"].shape[0], s=64.0, **ARCFACE)
    with torch.no_grad():
        head.weight.copy_(case["weight"])
    x = case["x"].clone().requires_grad_()
    loss = head(x, case["labels"])
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad


def lvface_steps(head: PartialFC | CombinedMarginLoss, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two stable-stage LVFace steps: the first fills the prototypes, the second is differentiated."""
    schedule = LVFaceSchedule(head, switch_epoch=0, sample_rate=1.0, prototype_weight=0.5)
    schedule(x.flip(0), labels.flip(0))
    x = x.clone().requires_grad_()
    loss = schedule(x, labels)
    loss.backward()
    return {"loss": loss.detach(), "x_grad": x.grad, "w_grad": head.weight.grad, "prototypes": schedule.prototypes}


def _worker(rank: int, world: int, init: str, out: str, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = []
        for (num_classes, sizes), case in cases:
            head = PartialFC(DIM, num_classes, sample_rate=1.0, margin="arcface", s=64.0)
            start, stop = shard_bounds(num_classes, rank, world)
            with torch.no_grad():
                head.weight.copy_(case["weight"][start:stop])
            lo = sum(sizes[:rank])
            x = case["x"][lo : lo + sizes[rank]].clone().requires_grad_()
            loss = head(x, case["labels"][lo : lo + sizes[rank]])
            loss.backward()
            # insightface's factor for a DDP-wrapped backbone: each rank's embedding gradient times W
            scaled = PartialFC(DIM, num_classes, ddp_backbone=True)
            with torch.no_grad():
                scaled.weight.copy_(case["weight"][start:stop])
            x_scaled = x.detach().clone().requires_grad_()
            scaled(x_scaled, case["labels"][lo : lo + sizes[rank]]).backward()
            # sampling across ranks: positives of the global batch are kept on whichever rank owns them
            sampled = PartialFC(DIM, num_classes, sample_rate=0.25, seed=3)
            sampled_loss = sampled(x.detach(), case["labels"][lo : lo + sizes[rank]])
            lv_head = PartialFC(DIM, num_classes)
            with torch.no_grad():
                lv_head.weight.copy_(case["weight"][start:stop])
            lvface = lvface_steps(lv_head, x.detach(), case["labels"][lo : lo + sizes[rank]])
            results.append(
                {
                    "loss": loss.detach(),
                    "x_grad": x.grad,
                    "w_grad": head.weight.grad,
                    "x_grad_ddp": x_scaled.grad,
                    "index": sampled.last_index + start,
                    "sampled_loss": sampled_loss,
                    "lvface": lvface,
                }
            )
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_single_process_full_softmax(tmp_path):
    cases = [((c, sizes), make_case(c, sizes, seed=i)) for i, (c, sizes) in enumerate(CASES)]
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'init'}", str(tmp_path), cases), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, ((num_classes, sizes), case) in enumerate(cases):
        loss, x_grad, w_grad = reference(case)
        got = [r[i] for r in ranks]
        for r in range(2):
            # the loss (≈ 50 at s = 64) may differ by one float32 ulp (3.8e-6): the exp-sum is split over ranks
            torch.testing.assert_close(got[r]["loss"], loss, atol=1e-6, rtol=1e-6)
            assert torch.isfinite(got[r]["sampled_loss"])
        torch.testing.assert_close(torch.cat([g["x_grad"] for g in got]), x_grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.cat([g["w_grad"] for g in got]), w_grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.cat([g["x_grad_ddp"] for g in got]), 2 * x_grad, atol=2e-6, rtol=0)
        assert got[0]["sampled_loss"] == got[1]["sampled_loss"]  # every rank returns the global loss
        kept = torch.cat([g["index"] for g in got])
        assert set(case["labels"].tolist()) <= set(kept.tolist())
        # LVFace's stable stage on sharded prototypes matches one process holding every class
        full = CombinedMarginLoss(DIM, num_classes, s=64.0, **ARCFACE)
        with torch.no_grad():
            full.weight.copy_(case["weight"])
        want = lvface_steps(full, case["x"], case["labels"])
        lv = [g["lvface"] for g in got]
        assert lv[0]["loss"] == lv[1]["loss"]
        torch.testing.assert_close(lv[0]["loss"], want["loss"], atol=1e-6, rtol=1e-6)
        for key in ("x_grad", "w_grad", "prototypes"):
            torch.testing.assert_close(torch.cat([g[key] for g in lv]), want[key], atol=1e-6, rtol=0)


def test_shard_bounds_cover_uneven_splits():
    bounds = [shard_bounds(10, r, 4) for r in range(4)]
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]


def test_single_process_equals_combined_margin_loss():
    torch.manual_seed(0)
    head = PartialFC(DIM, 12, margin={"m1": 1.0, "m2": 0.3, "m3": 0.2}, s=30.0)
    ref = CombinedMarginLoss(DIM, 12, s=30.0, m1=1.0, m2=0.3, m3=0.2)
    with torch.no_grad():
        ref.weight.copy_(head.weight)
    x, labels = torch.randn(9, DIM), torch.randint(0, 12, (9,))
    torch.testing.assert_close(head(x, labels), ref(x, labels), atol=1e-6, rtol=1e-6)


def test_sampling_keeps_positives_and_has_expected_size():
    head = PartialFC(DIM, 100, sample_rate=0.1)
    x = torch.randn(32, DIM)
    labels = torch.tensor([3, 3, 17, 42, 99, 0] * 5 + [17, 42])
    head(x, labels)
    index = head.last_index
    assert index.numel() == 10  # max(6 positives, round(0.1·100))
    assert set(labels.tolist()) <= set(index.tolist())
    assert torch.equal(index, index.sort().values) and index.unique().numel() == 10
    # more positives than rate·C: exactly the positives are kept
    many = torch.arange(0, 40)
    head(torch.randn(40, DIM), many)
    assert torch.equal(head.last_index, many)


def test_sampled_loss_is_the_softmax_over_the_kept_classes():
    torch.manual_seed(1)
    head = PartialFC(DIM, 50, sample_rate=0.2)
    x, labels = torch.randn(8, DIM), torch.randint(0, 50, (8,))
    loss = head(x, labels)
    index = head.last_index
    ref = CombinedMarginLoss(DIM, index.numel())
    with torch.no_grad():
        ref.weight.copy_(head.weight[index])
    torch.testing.assert_close(loss, ref(x, torch.searchsorted(index, labels)), atol=1e-5, rtol=1e-6)


def test_sampling_is_reproducible_per_step_and_off_in_eval():
    labels = torch.tensor([1, 2, 3])
    a, b = PartialFC(DIM, 60, sample_rate=0.3, seed=7), PartialFC(DIM, 60, sample_rate=0.3, seed=7)
    x = torch.randn(3, DIM)
    a(x, labels), b(x, labels)
    first = a.last_index
    assert torch.equal(first, b.last_index)
    a(x, labels)
    assert not torch.equal(first, a.last_index)  # a new step draws new negatives
    assert int(a.step) == 2
    a.eval()(x, labels)
    assert a.last_index.numel() == 60 and int(a.step) == 2
    a.train()
    a.sample_rate = 1.0  # switchable at runtime
    a(x, labels)
    assert a.last_index.numel() == 60


def test_distributed_cross_entropy_gradient_single_rank():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 6, 3, 3, 1])
    torch.autograd.gradcheck(distributed_cross_entropy, (logits, target))
    torch.testing.assert_close(distributed_cross_entropy(logits, target), F.cross_entropy(logits, target))


def test_rejects_bad_input():
    with pytest.raises(ConfigError, match="sample_rate"):
        PartialFC(DIM, 10, sample_rate=0.0)
    with pytest.raises(ConfigError, match="unknown"):
        PartialFC(DIM, 10, margin="sphereface")
    with pytest.raises(DataError, match=r"\[0, 10\)"):
        PartialFC(DIM, 10)(torch.randn(2, DIM), torch.tensor([0, 10]))
