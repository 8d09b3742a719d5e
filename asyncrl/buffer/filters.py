"""Sample filters of the replay queue, on plain Python floats (no torch, no Ray).

Each filter gives a terminal-state reason counted by the queue (invariant 3):

- `failed:<reason>`          the rollout failed; `<reason>` is the text before the first ':' of `failure`
- `filtered:overlong`        per trajectory, truncated at `rollout.max_tokens` (finish_reason == "length")
- `filtered:zero_variance`   per group, all rewards equal, so every group advantage is 0 (DAPO dynamic sampling)
- pass-rate curriculum       per prompt, retire prompts the policy already solves (ScaleRL "no positive
                             resampling"); retired prompts are never dispatched again, nothing is counted
                             as filtered because nothing is dispatched
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.types import Trajectory

FILTERED_OVERLONG = "filtered:overlong"
FILTERED_ZERO_VARIANCE = "filtered:zero_variance"
FILTERED_STRAGGLER = "filtered:straggler"
FILTERED_TOO_FEW_MEMBERS = "filtered:too_few_members"
"""A group of size >= 2 left with fewer than 2 usable members (group advantages need 2)."""

ZERO_VARIANCE_ATOL = 1e-9
"""Rewards closer than this count as equal (verifier rewards are exact 0/1; shaped ones may carry float noise)."""


def failure_reason(failure: str) -> str:
    """`"reward_error: division by zero"` -> `"reward_error"`; an empty text becomes `"unknown"`."""
    reason = failure.split(":", 1)[0].strip()
    return reason or "unknown"


def failed_state(failure: str) -> str:
    return f"failed:{failure_reason(failure)}"


def is_overlong(trajectory: Trajectory) -> bool:
    return trajectory.finish_reason == "length"


def is_zero_variance(rewards: Sequence[float], atol: float = ZERO_VARIANCE_ATOL) -> bool:
    """True when all rewards are equal (within `atol`): a group advantage of 0 for every member."""
    return len(rewards) > 0 and max(rewards) - min(rewards) <= atol


class PassRateTracker:
    """Running pass rate per prompt over all of its finished groups; retires prompts at `threshold`.

    The pass rate of a prompt is its mean reward over every successful rollout seen so far, which is the
    fraction of passing rollouts for the binary rewards of verifiable tasks.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._reward_sum: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self.retired: set[str] = set()

    def update(self, prompt_id: str, rewards: Sequence[float]) -> bool:
        """Add one group's rewards; True when this update retires the prompt."""
        if not rewards:
            return False
        self._reward_sum[prompt_id] = self._reward_sum.get(prompt_id, 0.0) + float(sum(rewards))
        self._count[prompt_id] = self._count.get(prompt_id, 0) + len(rewards)
        if prompt_id not in self.retired and self._reward_sum[prompt_id] / self._count[prompt_id] >= self.threshold:
            self.retired.add(prompt_id)
            return True
        return False

    def pass_rate(self, prompt_id: str) -> float | None:
        count = self._count.get(prompt_id, 0)
        return self._reward_sum[prompt_id] / count if count else None

    def is_retired(self, prompt_id: str) -> bool:
        return prompt_id in self.retired

    def state_dict(self) -> dict[str, Any]:
        return {
            "reward_sum": dict(self._reward_sum),
            "count": dict(self._count),
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reward_sum = {k: float(v) for k, v in state["reward_sum"].items()}
        self._count = {k: int(v) for k, v in state["count"].items()}
        self.retired = set(state["retired"])
