"""Margin softmax head against hand-computed logits on a 2-D toy problem."""

import math

import pytest
import torch
import torch.nn.functional as F

from ml.errors import ConfigError
from ml.fr.losses import ARCFACE, COSFACE, CombinedMarginLoss


def toy_head(s: float = 64.0, **margins: float) -> CombinedMarginLoss:
    """Two classes in 2-D: W_0 = (1, 0) at 0°, W_1 = (0, 1) at 90°."""
    head = CombinedMarginLoss(2, 2, s=s, **margins)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    return head


def at(degrees: float, norm: float = 3.0) -> torch.Tensor:
    """One embedding at ``degrees`` from W_0 (its norm must not matter)."""
    r = math.radians(degrees)
    return torch.tensor([[norm * math.cos(r), norm * math.sin(r)]])


LABEL0 = torch.tensor([0])


def test_arcface_logits_by_hand():
    # θ_0 = 30°, θ_1 = 60°. Target: 64·cos(30° + 0.5 rad) = 64·cos(1.02360) = 64·0.520296 = 33.2989.
    # Non-target: 64·cos 60° = 32.
    logits = toy_head(**ARCFACE).logits(at(30.0), LABEL0)
    assert logits[0, 0].item() == pytest.approx(33.2989, abs=1e-3)
    assert logits[0, 1].item() == pytest.approx(32.0, abs=1e-3)


def test_cosface_logits_by_hand():
    # Target: 64·(cos 30° − 0.4) = 64·(0.866025 − 0.4) = 29.8256; non-target 64·cos 60° = 32.
    logits = toy_head(**COSFACE).logits(at(30.0), LABEL0)
    assert logits[0, 0].item() == pytest.approx(29.8256, abs=1e-3)
    assert logits[0, 1].item() == pytest.approx(32.0, abs=1e-3)


def test_combined_margin_by_hand():
    # (m1, m2, m3) = (1, 0.3, 0.2): 64·(cos(30° + 0.3 rad) − 0.2) = 64·(cos 0.82360 − 0.2) = 30.6935.
    logits = toy_head(m1=1.0, m2=0.3, m3=0.2).logits(at(30.0), LABEL0)
    assert logits[0, 0].item() == pytest.approx(30.6935, abs=1e-3)


def test_multiplicative_margin_by_hand():
    # (m1, m2, m3) = (2, 0, 0) at 30°: 64·cos 60° = 32 (SphereFace-style angle doubling).
    logits = toy_head(m1=2.0, m2=0.0, m3=0.0).logits(at(30.0), LABEL0)
    assert logits[0, 0].item() == pytest.approx(32.0, abs=1e-3)


def test_non_target_logits_are_scaled_cosines():
    head = toy_head(s=10.0, **ARCFACE)
    x = torch.randn(5, 2)
    labels = torch.tensor([0, 1, 0, 1, 1])
    logits = head.logits(x, labels)
    cosine = F.normalize(x) @ torch.eye(2)
    other = 1 - labels
    torch.testing.assert_close(logits[torch.arange(5), other], 10.0 * cosine[torch.arange(5), other])


def test_theta_plus_margin_beyond_pi_uses_fallback():
    # θ_0 = 170°: θ + 0.5 rad = 3.467 > π, so the target is cos θ − m2·sin(m2)
    # = −0.984808 − 0.5·0.479426 = −1.224521, ×64 = −78.3693 (instead of 64·cos 3.467 = −60.7).
    # The non-target class is at 80°: 64·cos 80° = 11.1135.
    logits = toy_head(**ARCFACE).logits(at(170.0), LABEL0)
    assert logits[0, 0].item() == pytest.approx(-78.3693, abs=1e-3)
    assert logits[0, 1].item() == pytest.approx(11.1135, abs=1e-3)


def test_arcface_target_is_monotonic_with_one_step_at_the_switch():
    head = toy_head(s=1.0, **ARCFACE)
    theta = torch.linspace(0.0, math.pi, 2001, dtype=torch.float64)
    target = head.target_logit(torch.cos(theta).float())
    steps = target[1:] - target[:-1]
    assert (steps <= 1e-6).all()  # never rewards moving away from the class
    # The only jump is at θ = π − 0.5: from cos π = −1 to −cos 0.5 − 0.5·sin 0.5 = −1.117295.
    jumps = torch.nonzero(steps.abs() > 0.01).flatten()
    assert len(jumps) == 1
    assert theta[jumps[0]].item() == pytest.approx(math.pi - 0.5, abs=2e-3)
    assert steps[jumps[0]].item() == pytest.approx(-(math.cos(0.5) + 0.5 * math.sin(0.5) - 1.0), abs=5e-3)


def test_forward_is_cross_entropy_and_gradients_are_finite():
    head = toy_head(**ARCFACE)
    x = torch.tensor([[1.0, 0.0], [0.3, -2.0]], requires_grad=True)  # first sits exactly on W_0 (cos θ = 1)
    labels = torch.tensor([0, 1])
    loss = head(x, labels)
    assert loss.item() == pytest.approx(F.cross_entropy(head.logits(x, labels), labels).item())
    loss.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(head.weight.grad).all()


def test_invalid_margins_raise():
    with pytest.raises(ConfigError, match="s > 0"):
        CombinedMarginLoss(2, 2, s=0.0)
