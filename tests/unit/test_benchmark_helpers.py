"""Helpers of the W1 benchmark scripts (benchmarks/ is not a package: scripts import each other by path)."""

import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from learning_add import accuracy_at, run_figures, runs  # noqa: E402
from plain_grpo import group_advantages  # noqa: E402


def test_group_advantages_normalise_within_each_group():
    # Group 1: mean 0.25, sample std 0.5 -> (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5.
    # Group 2: all equal -> no signal.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]), atol=1e-5)


EVALS = [
    {"samples_trained": 0, "wall_s": 0.0, "accuracy": 0.3},
    {"samples_trained": 2560, "wall_s": 8.0, "accuracy": 0.52},
    {"samples_trained": 5120, "wall_s": 16.0, "accuracy": 0.71},
]


def test_run_figures_give_milestone_times_and_seconds_per_256_samples():
    figures = run_figures(EVALS, "wall_s")
    assert figures == {"time_to_0.5_s": 8.0, "time_to_0.7_s": 16.0, "s_per_256_samples": 0.8}  # 16 s / 20 steps


def test_accuracy_at_takes_the_last_evaluation_not_past_the_sample_count():
    assert [accuracy_at(EVALS, n) for n in (0, 2559, 2560, 10_000)] == [0.3, 0.3, 0.52, 0.71]


def test_mini_batch_runs_take_their_own_overrides_and_only_the_chosen_modes():
    planned = runs(4, ("streaming",), ["learner.lr=2.5e-5"])
    assert planned == [
        ("streaming", "default.yaml", []),
        ("streaming_mb4", "default.yaml", ["learner.mini_batches=4", "learner.lr=2.5e-5"]),
    ]
    assert [name for name, _, _ in runs(1)] == ["sync", "streaming", "sao"]
