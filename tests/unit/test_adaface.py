"""AdaFace head against hand-computed logits on a 2-D toy problem, and its norm-statistics EMA."""

import math

import pytest
import torch

from ml.errors import ConfigError
from ml.fr.losses import AdaFaceLoss


def toy_head(mean: float = 20.0, std: float = 10.0, **kwargs: float) -> AdaFaceLoss:
    """Two classes in 2-D: W_0 = (1, 0), W_1 = (0, 1); norm statistics set explicitly."""
    head = AdaFaceLoss(2, 2, **kwargs)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        head.batch_mean.fill_(mean)
        head.batch_std.fill_(std)
    return head


def at(degrees: float, norm: float) -> list[float]:
    r = math.radians(degrees)
    return [norm * math.cos(r), norm * math.sin(r)]


def test_logits_by_hand():
    # m = 0.4, h = 0.333, s = 64, μ = 20, σ = 10, ε = 1e-3; every sample at θ_0 = 30° = 0.523599 rad.
    # norm 30:  ĝ = 0.333·10/10.001 = 0.332967; θ' = 0.523599 − 0.4·0.332967 = 0.390412;
    #           64·(cos 0.390412 − (0.4 + 0.4·0.332967)) = 64·(0.924752 − 0.533187) = 25.0602
    # norm 200: clipped to 100, ĝ = clip(0.333·80/10.001) = 1; 64·(cos(0.523599 − 0.4) − 0.8) = 12.3118
    # norm 5:   ĝ = −0.333·15/10.001 = −0.499450; θ' = 0.723379;
    #           64·(cos 0.723379 − 0.200220) = 64·(0.749574 − 0.200220) = 35.1586
    head = toy_head().eval()  # eval: statistics stay as set
    x = torch.tensor([at(30.0, 30.0), at(30.0, 200.0), at(30.0, 5.0)])
    logits = head.logits(x, torch.tensor([0, 0, 0]))
    torch.testing.assert_close(logits[:, 0], torch.tensor([25.0602, 12.3118, 35.1586]), atol=1e-3, rtol=0)
    # non-target: 64·cos 60° = 32, no margin whatever the norm
    torch.testing.assert_close(logits[:, 1], torch.full((3,), 32.0), atol=1e-3, rtol=0)
    assert head.batch_mean.item() == 20.0 and head.batch_std.item() == 10.0


def test_margin_scaler_extremes_are_arcface_and_hard_emphasis():
    head = toy_head(mean=20.0, std=1.0).eval()
    x = torch.tensor([at(50.0, 0.5), at(50.0, 90.0)])
    logits = head.logits(x, torch.tensor([0, 0]))
    t = math.radians(50.0)
    # ĝ = −1: ArcFace 64·cos(θ + m); ĝ = +1: 64·(cos(θ − m) − 2m)
    assert logits[0, 0].item() == pytest.approx(64 * math.cos(t + 0.4), abs=1e-3)
    assert logits[1, 0].item() == pytest.approx(64 * (math.cos(t - 0.4) - 0.8), abs=1e-3)


def test_ema_update_by_hand():
    # norms 10 and 50: batch mean 30, unbiased std 28.284271;
    # μ = 0.01·30 + 0.99·20 = 20.1, σ = 0.01·28.284271 + 0.99·100 = 99.282843
    head = AdaFaceLoss(2, 3)
    x = torch.tensor([[10.0, 0.0], [0.0, 50.0]])
    head(x, torch.tensor([0, 1]))
    assert head.batch_mean.item() == pytest.approx(20.1, abs=1e-5)
    assert head.batch_std.item() == pytest.approx(99.282843, abs=1e-4)
    # norms are clipped to [0.001, 100] before the statistics: mean (0.001 + 100)/2
    head = AdaFaceLoss(2, 3, t_alpha=1.0)
    head(torch.tensor([[1e-5, 0.0], [0.0, 500.0]]), torch.tensor([0, 1]))
    assert head.batch_mean.item() == pytest.approx(50.0005, abs=1e-4)
    assert head.batch_std.item() == pytest.approx(99.999 / math.sqrt(2), abs=1e-3)


def test_no_update_in_eval_or_std_for_single_sample():
    head = AdaFaceLoss(2, 3).eval()
    head(torch.tensor([[10.0, 0.0], [0.0, 50.0]]), torch.tensor([0, 1]))
    assert (head.batch_mean.item(), head.batch_std.item()) == (20.0, 100.0)
    head.train()(torch.tensor([[40.0, 0.0]]), torch.tensor([0]))
    assert head.batch_mean.item() == pytest.approx(20.2)
    assert head.batch_std.item() == 100.0


def test_norm_is_not_a_target():
    # the norm only picks the margin (detached): the gradient is orthogonal to each embedding
    head = AdaFaceLoss(8, 5)
    x = (torch.randn(6, 8) * 20).requires_grad_()
    head(x, torch.tensor([0, 1, 2, 3, 4, 0])).backward()
    radial = (x.grad * x.detach()).sum(dim=1)
    torch.testing.assert_close(radial, torch.zeros(6), atol=1e-5, rtol=0)
    assert torch.isfinite(head.weight.grad).all()


def test_rejects_bad_config():
    with pytest.raises(ConfigError, match="h > 0"):
        AdaFaceLoss(8, 5, h=0.0)
