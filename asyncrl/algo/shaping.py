"""Reward shaping and sampling filters: DAPO overlong punishment (applied by the recipe,
`recipes.shape_rewards`, when the learner builds its batch), dynamic sampling / zero-variance filtering
and the pass-rate curriculum (the replay buffer runs its own `asyncrl.buffer.filters`).

References: DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476 (verl `reward_manager/dapo.py`,
`docs/algo/dapo.md`); ScaleRL, Khatri et al. 2025, https://arxiv.org/abs/2510.13786.
Formulas: docs/algorithms.md#reward-shaping-and-filters.

Plain Python on floats and lists, so the buffer need not import torch; `zero_variance_keep` also
accepts tensors.

Where this departs from references:
- Beyond `max_length` the overlong reward is `-penalty_factor` (the DAPO formula's -1); verl's linear
  formula keeps decreasing below -1 there.
- The 0.9 retirement threshold of No-Positive-Resampling comes from secondary summaries of ScaleRL.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["group_has_variance", "overlong_penalty", "pass_rate", "retire_mask", "should_retire", "zero_variance_keep"]


def overlong_penalty(
    length: int, max_length: int = 20480, cache_length: int = 4096, penalty_factor: float = 1.0
) -> float:
    """DAPO soft overlong punishment added to the task reward (docs/algorithms.md#reward-shaping-and-filters).

    0 up to `max_length - cache_length` tokens, then linear down to -1 at `max_length`, -1 beyond
    (all scaled by `penalty_factor`).
    """
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length > max_length:
        return -1.0 * penalty_factor
    return (expected - length) / cache_length * penalty_factor


def group_has_variance(rewards: Sequence[float]) -> bool:
    """False when every reward of the group is equal (its group advantage is 0), DAPO `filter_groups`."""
    values = [float(r) for r in rewards]
    return len(values) > 0 and max(values) != min(values)


def zero_variance_keep(groups: Sequence[Sequence[float]]) -> list[bool]:
    """Dynamic sampling (DAPO) / zero-variance filtering (ScaleRL): keep flag per group
    (docs/algorithms.md#reward-shaping-and-filters)."""
    return [group_has_variance(g) for g in groups]


def pass_rate(rewards: Sequence[float], success_threshold: float = 1.0) -> float:
    """Fraction of rewards >= success_threshold (binary 0/1 and +-1 rewards: the success rate)."""
    values = [float(r) for r in rewards]
    return sum(v >= success_threshold for v in values) / len(values) if values else 0.0


def should_retire(rate: float, threshold: float = 0.9) -> bool:
    """ScaleRL No-Positive-Resampling: retire a prompt for good once its pass rate is >= threshold."""
    return rate >= threshold


def retire_mask(pass_rates: Sequence[float], threshold: float = 0.9) -> list[bool]:
    """`should_retire` for each prompt."""
    return [should_retire(float(r), threshold) for r in pass_rates]
