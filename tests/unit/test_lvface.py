"""LVFace schedule: sampling before the switch only, prototype EMA by hand, λ = 0 is the plain head."""

import math

import pytest
import torch

from ml.errors import ConfigError
from ml.fr.losses import ARCFACE, CombinedMarginLoss, LVFaceSchedule, PartialFC

DIM = 8


def unit_2d_head(kind: str):
    """Two classes in 2-D: W_0 = (1, 0), W_1 = (0, 1)."""
    head = PartialFC(2, 2, margin="arcface") if kind == "partial_fc" else CombinedMarginLoss(2, 2, **ARCFACE)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    return head


def at(degrees: float, norm: float = 2.0) -> list[float]:
    r = math.radians(degrees)
    return [norm * math.cos(r), norm * math.sin(r)]


def test_samples_before_the_switch_and_not_after():
    torch.manual_seed(0)
    schedule = LVFaceSchedule(PartialFC(DIM, 40), switch_epoch=2, sample_rate=0.25)
    x, labels = torch.randn(6, DIM), torch.tensor([0, 5, 5, 9, 30, 39])
    for epoch in (0, 1):
        schedule.on_epoch_start(epoch)
        assert not schedule.stable and schedule.head.sample_rate == 0.25
        schedule(x, labels)
        assert schedule.head.last_index.numel() == 10  # max(5 positives, round(0.25·40))
        assert not schedule.prototype_seen.any()  # no prototypes in the early stage
    schedule.on_epoch_start(2)
    assert schedule.stable and schedule.head.sample_rate == 1.0
    schedule(x, labels)
    assert schedule.head.last_index.numel() == 40
    assert schedule.prototype_seen.nonzero().squeeze(1).tolist() == [0, 5, 9, 30, 39]


def test_early_stage_is_the_head_loss():
    torch.manual_seed(0)
    head = PartialFC(DIM, 30, seed=4)
    schedule = LVFaceSchedule(head, switch_epoch=1, sample_rate=0.5)
    x, labels = torch.randn(5, DIM), torch.randint(0, 30, (5,))
    loss = schedule(x, labels)
    head.step.zero_()  # same step, same draw
    torch.testing.assert_close(loss, head(x, labels))


def test_prototype_ema_by_hand():
    schedule = LVFaceSchedule(CombinedMarginLoss(2, 3), switch_epoch=0, sample_rate=1.0, prototype_momentum=0.9)
    # step 1: class 0 sees unit (1, 0) and (0, 1) → mean (0.5, 0.5), its first observation sets p_0;
    # class 2 sees (0, −1); class 1 is absent
    schedule(torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, -0.5]]), torch.tensor([0, 0, 2]))
    expected = torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.0, -1.0]])
    torch.testing.assert_close(schedule.prototypes, expected)
    assert schedule.prototype_seen.tolist() == [True, False, True]
    # step 2: class 0 sees (−1, 0): p_0 = 0.9·(0.5, 0.5) + 0.1·(−1, 0) = (0.35, 0.45); classes 1, 2 untouched
    schedule(torch.tensor([[-4.0, 0.0]]), torch.tensor([0]))
    expected[0] = torch.tensor([0.35, 0.45])
    torch.testing.assert_close(schedule.prototypes, expected)
    assert schedule.prototype_seen.tolist() == [True, False, True]
    # no update in eval mode
    schedule.eval()(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
    torch.testing.assert_close(schedule.prototypes, expected)


@pytest.mark.parametrize("kind", ["combined", "partial_fc"])
def test_zero_prototype_weight_is_the_plain_head(kind):
    torch.manual_seed(0)
    head = PartialFC(DIM, 12) if kind == "partial_fc" else CombinedMarginLoss(DIM, 12)
    schedule = LVFaceSchedule(head, switch_epoch=0, sample_rate=1.0, prototype_weight=0.0)
    for _ in range(3):  # fill prototypes
        schedule(torch.randn(6, DIM), torch.randint(0, 12, (6,)))
    assert schedule.prototype_seen.any()
    x, labels = torch.randn(7, DIM), torch.randint(0, 12, (7,))
    torch.testing.assert_close(schedule(x, labels), head(x, labels), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kind", ["combined", "partial_fc"])
def test_prototype_pulls_the_target_centre_towards_the_class_features(kind):
    # x at 60° with label 0; W_0 at 0°; p_0 at 60°. λ = 0.5 → w̃_0 = normalise(½(1, 0) + ½(cos 60°, sin 60°)),
    # the bisector at 30°: target 64·cos(30° + 0.5 rad) = 33.2989 instead of 64·cos(60° + 0.5 rad) = 1.5102.
    # The non-target logit keeps W_1 = (0, 1): 64·cos 30° = 55.4256.
    schedule = LVFaceSchedule(unit_2d_head(kind), switch_epoch=0, sample_rate=1.0, prototype_weight=0.5)
    x, labels = torch.tensor([at(60.0)]), torch.tensor([0])
    before = schedule.logits(x, labels)
    torch.testing.assert_close(before, torch.tensor([[1.5102, 55.4256]]), atol=1e-3, rtol=0)
    with torch.no_grad():
        schedule.prototypes[0] = torch.tensor([math.cos(math.pi / 3), math.sin(math.pi / 3)])
        schedule.prototype_seen[0] = True
    after = schedule.logits(x, labels)
    torch.testing.assert_close(after, torch.tensor([[33.2989, 55.4256]]), atol=1e-3, rtol=0)
    assert after[0, 0] > before[0, 0]


def test_rejects_sampling_without_partial_fc():
    with pytest.raises(ConfigError, match="needs a PartialFC head"):
        LVFaceSchedule(CombinedMarginLoss(DIM, 10), switch_epoch=2, sample_rate=0.5)
