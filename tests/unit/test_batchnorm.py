"""Global BatchNorm (ml/train/batchnorm.py): with two gloo ranks it normalises, backpropagates and tracks running
statistics as one BatchNorm over both ranks' batches; alone it is that BatchNorm."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ml.train.batchnorm import GlobalBatchNorm1d, GlobalBatchNorm2d, global_batchnorm
from tests.servers import free_port


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                         nn.BatchNorm1d(5))


def test_conversion_keeps_parameters_and_keys_and_alone_changes_nothing():
    plain, converted = _net(), global_batchnorm(_net())
    assert [type(m) for m in converted if "BatchNorm" in type(m).__name__] == [GlobalBatchNorm2d, GlobalBatchNorm1d]
    assert plain.state_dict().keys() == converted.state_dict().keys()
    x = torch.randn(6, 3, 8, 8)
    torch.testing.assert_close(converted(x), plain(x), rtol=0, atol=0)  # no process group: BatchNorm itself
    torch.testing.assert_close(converted[1].running_mean, plain[1].running_mean, rtol=0, atol=0)


def _rank(rank: int, port: int, x: torch.Tensor, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        net = global_batchnorm(_net())
        part = x[rank * 4:(rank + 1) * 4].clone().requires_grad_(True)
        y = net(part)
        (y.square().sum() / len(x)).backward()  # the global batch's loss, summed over ranks
        out[rank] = (y.detach(), part.grad, net[0].weight.grad.clone(), net[4].running_mean.clone(),
                     net[4].running_var.clone())
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_batchnorm_over_the_global_batch():
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    net = _net()
    whole = x.clone().requires_grad_(True)
    y = net(whole)
    (y.square().sum() / len(x)).backward()
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), x, out), nprocs=2, join=True)
    torch.testing.assert_close(torch.cat([out[0][0], out[1][0]]), y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([out[0][1], out[1][1]]), whole.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(out[0][2] + out[1][2], net[0].weight.grad, atol=1e-6, rtol=1e-4)  # DDP sums, /N
    for rank in (0, 1):
        torch.testing.assert_close(out[rank][3], net[4].running_mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out[rank][4], net[4].running_var, atol=1e-6, rtol=1e-5)


def test_subclasses_with_their_own_forward_are_left_alone():
    class Custom(nn.BatchNorm1d):
        pass

    net = global_batchnorm(nn.Sequential(Custom(3)))
    assert type(net[0]) is Custom
    with pytest.raises(ValueError):
        GlobalBatchNorm1d(3)(torch.randn(2, 3, 4, 5))  # BatchNorm1d's own input check still applies
