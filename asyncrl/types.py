"""Typed records passed between actors.

Each docstring states the record's invariant. Arrays are numpy so Ray moves them without pickling
element by element; nothing here imports torch, Ray or vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort", "error", "max_turns", "context", "timeout", "tool_error"]
"""Why a trajectory ended: the engine's reasons for one generation (`stop` = end-of-sequence, `length` = max_tokens),
and an episode's (`max_turns`, `context` = total tokens, `timeout` = wall time, `tool_error`)."""

# Terminal states of a dispatched sample (invariant 3). `filtered:<reason>` and `failed:<reason>` carry a reason.
TRAINED = "trained"
DROPPED_STALE = "dropped_stale"
STALE_FAILURE = "stale"
"""`failure` reason (text before the first ':') of a request its engine aborted because it was certain to exceed
`max_staleness`; the replay queue ends it, and its group, `dropped_stale` rather than `failed:`."""


@dataclass
class Prompt:
    """One task instance. `prompt_ids` are the tokens fed to the engine (chat template already applied)."""

    prompt_id: str
    prompt_ids: list[int]
    ground_truth: str
    text: str = ""
    data_source: str = "add"
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One rollout of one prompt.

    Invariant: `rollout_logprobs`, `loss_mask` and `versions` all have the length of `response_ids`.
    `rollout_logprobs[t]` is log mu(token t) under the distribution the engine sampled from
    (temperature/top-p applied). `loss_mask[t]` is 1 for policy-generated tokens and 0 for tokens the
    environment appended (tool observations). `versions[t]` is the policy version that produced token t;
    a trajectory that lived through an in-flight weight update spans several versions.
    """

    prompt_id: str
    group_id: str
    sample_index: int
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [T]
    rollout_logprobs: np.ndarray  # float32 [T]
    loss_mask: np.ndarray  # int8 [T]
    versions: np.ndarray  # int32 [T]
    finish_reason: FinishReason
    ground_truth: str = ""
    reward: float = 0.0
    failure: str | None = None
    """Why the trajectory failed (`timeout`, `reward_error: ...`, `engine_died: worker-1`), None if it did not."""
    worker: str = ""
    attempt: int | None = None
    """The attempt number of the request this answers (`Request.attempt`); None = unknown, and then the
    queue matches by `worker` only."""
    dispatch_version: int = 0
    """Policy version of the engine when the request started (lower bound of `versions`)."""
    submitted_at: float = 0.0
    finished_at: float = 0.0
    response_text: str = ""
    turn_starts: list[int] = field(default_factory=lambda: [0])
    """Offsets in `response_ids` where each model turn starts; the tokens between one turn's end and the next
    turn's start are an environment observation (`loss_mask` 0). A single-turn trajectory has `[0]`."""
    truncated: bool = False
    """The episode was cut by a limit (max turns, context, wall time, max_tokens) rather than ended by the
    model or the environment: GAE bootstraps from the value of its last state instead of treating it as terminal."""
    tool_calls: int = 0
    """Tool calls the model made during the episode (0 for environments without tools)."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.rollout_logprobs) == len(self.loss_mask) == len(self.versions) == n):
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: per-token arrays differ in length "
                f"(ids {n}, logprobs {len(self.rollout_logprobs)}, mask {len(self.loss_mask)}, versions {len(self.versions)})"
            )

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else self.dispatch_version

    @property
    def max_version(self) -> int:
        return int(self.versions.max()) if len(self.versions) else self.dispatch_version

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    @property
    def turn_versions(self) -> list[int]:
        """The policy version of each model turn's first token (a turn may span several: see `versions`)."""
        return [int(self.versions[s]) if s < len(self.versions) else self.dispatch_version for s in self.turn_starts]

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def replace(self, **changes: Any) -> Trajectory:
        return dataclasses.replace(self, **changes)


@dataclass
class Group:
    """The readiness unit handed to the learner: all trajectories of one prompt (one in `sao`).

    Invariant: every member shares `group_id` and `prompt_id`; `min_version` is the oldest token's version.
    """

    group_id: str
    trajectories: list[Trajectory]

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


@dataclass
class Batch:
    """What the replay queue hands the learner for one step: groups, the learner version they were handed
    out at, and each sample's lag.

    Invariant: `lags[k] == version - min_version` of the k-th trajectory (groups in order, members in order),
    computed once, here, when the queue hands the batch out; the queue never hands out a lag above
    `max_staleness`. Every staleness figure downstream (metrics rows, histograms) is read from `lags`.
    """

    groups: list[Group]
    version: int
    lags: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lags = [self.version - t.min_version for g in self.groups for t in g.trajectories]

    @property
    def num_samples(self) -> int:
        return len(self.lags)

    @property
    def staleness_mean(self) -> float:
        """Mean lag in policy versions (0.0 for an empty batch)."""
        return sum(self.lags) / max(1, len(self.lags))

    @property
    def staleness_max(self) -> int:
        return max(self.lags, default=0)


@dataclass
class StepStats:
    """What the learner reports for one optimizer step; every field is a plain number."""

    step: int
    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Request:
    """One generation for a rollout worker: sample `sample_index` of the group of `prompt`.

    `request_id` is unique per attempt (`<group_id>/<sample_index>/<attempt>`): a request re-dispatched
    after its worker died gets a new attempt number, so a late answer of the old attempt is recognisable.
    """

    request_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt: Prompt
    attempt: int = 0
