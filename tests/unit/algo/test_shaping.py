"""Reward shaping and sampling filters of docs/algorithms.md#reward-shaping-and-filters."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.shaping import overlong_penalty, pass_rate, retire_mask, zero_variance_keep


@pytest.mark.parametrize(
    "length, expected",
    [(16000, 0.0), (16384, 0.0), (16385, -0.000244), (18000, -0.394531), (20480, -1.0), (21000, -1.0)],
)
def test_dapo_overlong_penalty_matches_spec(length, expected):
    # (16384 - 18000) / 4096 = -0.394531
    assert overlong_penalty(length, 20480, 4096) == pytest.approx(expected, abs=1e-6)


def test_dynamic_sampling_keeps_groups_with_reward_variance():
    assert zero_variance_keep([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 0]]) == [False, False, True, True]
    assert zero_variance_keep(torch.tensor([[0.5, 0.5], [0.5, 0.25]])) == [False, True]


def test_prompts_with_pass_rate_at_least_ninety_percent_are_retired():
    assert retire_mask([1.0, 0.0, 0.5, 0.75]) == [True, False, False, False]
    assert retire_mask([0.9, 0.8999]) == [True, False]
    assert pass_rate([1, 0, 1, 1]) == 0.75
    assert pass_rate([1, -1, -1, 1]) == 0.5
