"""The learning-rate schedule (`learner.warmup_steps`, `lr_decay`, `min_lr_ratio`): factors checked by hand, and
the rates a real AdamW sees through the scheduler the learner builds."""

import math

import pytest
import torch
from pydantic import ValidationError

from asyncrl.config import LearnerConfig
from asyncrl.learner.state import lr_factor


def _factors(n: int, **kw) -> list[float]:
    factor = lr_factor(LearnerConfig(**kw))
    return [factor(step) for step in range(n)]


def test_constant_after_a_linear_warmup():
    assert _factors(6, warmup_steps=4, max_steps=10) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert _factors(3, max_steps=10) == [1.0, 1.0, 1.0]


def test_linear_decay_reaches_its_floor_after_the_last_step():
    # 10 updates, no warm-up, to 0: 1 - k / 10
    assert _factors(11, lr_decay="linear", max_steps=10) == pytest.approx([1 - k / 10 for k in range(11)])
    # a floor of 0.2: 0.2 + 0.8 (1 - k / 4); update 2 of 4 runs at 0.6
    assert _factors(5, lr_decay="linear", max_steps=4, min_lr_ratio=0.2) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_cosine_decay_after_warmup_holds_its_floor_past_max_steps():
    f = lr_factor(LearnerConfig(lr_decay="cosine", warmup_steps=2, max_steps=12, min_lr_ratio=0.1))
    assert [f(0), f(1), f(2)] == pytest.approx([0.5, 1.0, 1.0])
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the 10 decay steps
    assert f(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert f(12) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)  # a resumed run past max_steps


def test_adamw_steps_at_the_scheduled_rates():
    cfg = LearnerConfig(lr=1e-2, lr_decay="linear", warmup_steps=1, max_steps=5)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1e-2, 1e-2, 7.5e-3, 5e-3, 2.5e-3])
    # the state a checkpoint keeps restores the position in the schedule
    again = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([weight], lr=cfg.lr), lr_factor(cfg))
    again.load_state_dict(scheduler.state_dict())
    assert again.get_last_lr() == pytest.approx([0.0])


def test_decay_without_steps_after_the_warmup_is_refused_naming_both_keys():
    with pytest.raises(ValidationError, match="max_steps .10. must exceed warmup_steps .10."):
        LearnerConfig(lr_decay="cosine", warmup_steps=10, max_steps=10)
    with pytest.raises(ValidationError, match="lr_decay"):
        LearnerConfig(lr_decay="exponential")
