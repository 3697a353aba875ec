"""The learning-rate schedule: multipliers at chosen steps, written out by hand from the formula
in recsys/train/schedule.py and the [train] docs (lr_schedule, warmup_steps, min_lr_ratio)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from recsys.config import TrainConfig
from recsys.embedding.optim import SGD, Adagrad
from recsys.train.schedule import LRSchedule

# S = 10 steps, W = 3 warmup steps, r = 0.1: warmup (s + 1) / W for s = 0, 1, 2; then
# p = (s - W) / (S - W - 1) = (s - 3) / 6 for s = 3 .. 9, reaching 1 at the last step, s = 9.
TOTAL, WARMUP, RATIO = 10, 3, 0.1
WARMUP_PART = [1 / 3, 2 / 3, 1.0]
ROOT3 = math.sqrt(3.0)
EXPECTED = {
    "constant": [*WARMUP_PART, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    # 1 - (1 - r) p = 1 - 0.9 k / 6 for k = s - 3 = 0 .. 6
    "linear": [*WARMUP_PART, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1],
    # r + (1 - r) (1 + cos(pi k / 6)) / 2 with cos(pi k / 6) = 1, √3/2, 1/2, 0, -1/2, -√3/2, -1
    "cosine": [
        *WARMUP_PART,
        1.0,
        0.1 + 0.9 * (2 + ROOT3) / 4,
        0.775,
        0.55,
        0.325,
        0.1 + 0.9 * (2 - ROOT3) / 4,
        0.1,
    ],
}


def schedule(kind, total=TOTAL, warmup=WARMUP, ratio=RATIO, optimizers=(), fused=()):
    config = TrainConfig(lr_schedule=kind, warmup_steps=warmup, min_lr_ratio=ratio)
    return LRSchedule(config, total, list(optimizers), list(fused))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_multiplier_at_every_step_matches_the_formula_by_hand(kind):
    # Every step is checked, so an off-by-one anywhere (s / W instead of (s + 1) / W, warmup
    # running one step longer, p counted from s - W + 1, or S - W instead of S - W - 1 in p's
    # denominator) changes at least one of: step 0, the first step after warmup, or the last.
    lr = schedule(kind)
    got = [lr.multiplier(step) for step in range(TOTAL)]
    assert got == pytest.approx(EXPECTED[kind], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_chosen_steps_of_a_decay(kind):
    lr = schedule(kind)
    assert lr.multiplier(0) == pytest.approx(1 / WARMUP)  # lr / warmup_steps at the first step
    assert lr.multiplier(WARMUP - 1) == 1.0  # the last warmup step runs at the full rate
    assert lr.multiplier(WARMUP) == 1.0  # decay starts from 1
    assert lr.multiplier(6) == pytest.approx(0.55)  # p = 1/2: both halfway from 1 to r
    assert lr.multiplier(TOTAL - 1) == pytest.approx(RATIO)  # the last step runs at r exactly
    assert lr.multiplier(TOTAL + 5) == pytest.approx(RATIO)  # past the end: stays at r


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_without_warmup_and_to_zero(kind):
    lr = schedule(kind, total=5, warmup=0, ratio=0.0)
    # p = s / 4: linear 1 - p; cosine (1 + cos(pi p)) / 2
    expected = {
        "linear": [1.0, 0.75, 0.5, 0.25, 0.0],
        "cosine": [1.0, (2 + math.sqrt(2)) / 4, 0.5, (2 - math.sqrt(2)) / 4, 0.0],
    }[kind]
    assert [lr.multiplier(s) for s in range(5)] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_decay_over_one_or_two_steps():
    # Two steps after warmup: the first at 1, the last at r.
    lr = schedule("linear", total=5)
    assert [lr.multiplier(s) for s in (3, 4)] == pytest.approx([1.0, RATIO], rel=1e-12)
    # One step after warmup (S - W - 1 = 0): the formula's max(., 1) keeps it at 1, so such a
    # run never reaches r.
    assert schedule("linear", total=4).multiplier(3) == 1.0
    assert schedule("cosine", total=1, warmup=0).multiplier(0) == 1.0


def test_warmup_longer_than_the_run_only_ramps():
    lr = schedule("cosine", total=4, warmup=8)
    assert [lr.multiplier(s) for s in range(4)] == [1 / 8, 2 / 8, 3 / 8, 4 / 8]


def test_apply_sets_every_param_group_and_every_fused_optimizer():
    weights = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    adam = torch.optim.Adam(
        [{"params": weights[:2], "lr": 0.01}, {"params": weights[2:], "lr": 0.002}]
    )
    sgd = torch.optim.SGD(weights[:1], lr=0.3)
    table_sgd, table_adagrad = SGD(lr=0.5), Adagrad(lr=0.05)
    # One fused optimizer shared by two collections is listed twice: still base * factor.
    lr = schedule("cosine", optimizers=[adam, sgd], fused=[table_sgd, table_adagrad, table_sgd])
    for step in [0, 2, 3, 5, 9, 4, 0]:  # out of order: the rates depend on the step alone
        lr.apply(step)
        factor = EXPECTED["cosine"][step]
        assert [g["lr"] for g in adam.param_groups] == pytest.approx(
            [0.01 * factor, 0.002 * factor]
        )
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.3 * factor)
        assert table_sgd.lr == pytest.approx(0.5 * factor)
        assert table_adagrad.lr == pytest.approx(0.05 * factor)
    lr.apply(5)
    lr.apply(5)  # applying twice does not compound
    assert table_sgd.lr == pytest.approx(0.5 * EXPECTED["cosine"][5])
    assert adam.param_groups[1]["lr"] == pytest.approx(0.002 * EXPECTED["cosine"][5])


def test_a_torch_step_after_apply_uses_the_scheduled_rate():
    weight = torch.nn.Parameter(torch.randn(4))
    sgd = torch.optim.SGD([weight], lr=0.2)
    lr = schedule("linear", optimizers=[sgd])
    before = weight.detach().clone()
    lr.apply(5)  # 0.7
    weight.grad = torch.ones(4)
    sgd.step()
    torch.testing.assert_close(weight.detach(), before - 0.2 * 0.7, rtol=0, atol=1e-7)


def test_rates_survive_loading_an_optimizer_state():
    """A resumed run builds the schedule on fresh optimizers, then loads their saved state,
    which replaces the param-group dicts and their (decayed) lr: the next step must still run
    at base * multiplier, not decayed * multiplier."""
    weights = [torch.nn.Parameter(torch.randn(2)) for _ in range(2)]
    groups = [{"params": weights[:1], "lr": 0.01}, {"params": weights[1:], "lr": 0.03}]
    saving = torch.optim.Adam(groups)
    schedule("linear", optimizers=[saving]).apply(6)  # 0.55
    saved = saving.state_dict()
    fresh = torch.optim.Adam(
        [{"params": weights[:1], "lr": 0.01}, {"params": weights[1:], "lr": 0.03}]
    )
    lr = schedule("linear", optimizers=[fresh])
    fresh.load_state_dict(saved)
    assert fresh.param_groups[1]["lr"] == pytest.approx(0.03 * 0.55)  # the saved, decayed rate
    lr.apply(7)  # 0.4
    assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.01 * 0.4, 0.03 * 0.4])


def test_state_dict_round_trip():
    lr = schedule("cosine")
    state = lr.state_dict()
    assert state == {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1, "total_steps": 10}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded == state
    rebuilt = schedule(
        loaded["kind"], loaded["total_steps"], loaded["warmup_steps"], loaded["min_lr_ratio"]
    )
    assert [rebuilt.multiplier(s) for s in range(12)] == [lr.multiplier(s) for s in range(12)]


def test_total_steps_set_after_construction_moves_the_end():
    # The trainer sets schedule.total_steps when a resume with other batch sizes ends elsewhere.
    lr = schedule("linear")
    lr.total_steps = 7  # decay over s = 3 .. 6: p = (s - 3) / 3
    assert [lr.multiplier(s) for s in range(3, 7)] == pytest.approx([1.0, 0.7, 0.4, 0.1])
    assert lr.state_dict()["total_steps"] == 7


@pytest.mark.parametrize(
    ("warmup", "ratio", "message"),
    [
        (-1, 0.0, r"train.warmup_steps = -1; expected >= 0"),
        (0, 1.5, r"train.min_lr_ratio = 1.5; expected in \[0, 1\]"),
        (0, -0.1, r"train.min_lr_ratio = -0.1; expected in \[0, 1\]"),
    ],
)
def test_bad_settings_name_the_key_and_value(warmup, ratio, message):
    with pytest.raises(ValueError, match=message):
        schedule("linear", warmup=warmup, ratio=ratio)
