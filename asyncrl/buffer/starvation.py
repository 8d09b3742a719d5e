"""Starvation: a run whose groups all end filtered or failed gives the learner nothing to train on.

The queue records how every group was resolved (`GroupOutcomes`): ready for the learner, or the reason it
ended without a usable member (`filtered:zero_variance`, `filtered:too_few_members`, `filtered:straggler`,
`filtered:overlong`, `failed:<reason>`). The run asks for a `Starvation` record, one cheap actor call, while the
learner waits; when every group since the last ready one was filtered, the run says so live and, if no batch
comes before its wait ends, stops with a `StarvedError` naming the reasons and what to change, instead of a
queue timeout that points at the queue.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from asyncrl.buffer import filters

READY = "ready"
"""The outcome of a group handed on to the learner's ready list."""


class StarvedError(RuntimeError):
    """No batch within the learner's wait, and every recent group was filtered or failed: nothing can be trained."""


@dataclass(frozen=True)
class Starvation:
    """How the queue's groups were resolved: in all, and since the last one that became ready.

    Invariant: `sum(since_ready.values())` groups were resolved after the last ready one, none of them ready.
    """

    groups_resolved: int = 0
    groups_ready: int = 0
    since_ready: dict[str, int] = field(default_factory=dict)
    """Outcome (`filtered:zero_variance`, `failed:reward_error`, ...) -> groups, since the last ready group."""
    zero_variance_rewards: tuple[float, float] | None = None
    """Lowest and highest reward of the zero-variance groups since the last ready group (each group's reward
    is one value); None when there were none."""
    seconds_since_ready: float = 0.0
    """Since the last ready group (or since the queue started, when none was ever ready)."""

    @property
    def groups_since_ready(self) -> int:
        return sum(self.since_ready.values())

    def starved(self, min_groups: int) -> bool:
        """True when at least `min_groups` groups in a row ended without a ready one."""
        return self.groups_since_ready >= max(1, min_groups)

    def describe(self) -> str:
        """'the last 12 groups were all filtered (zero_variance 12: every reward was 0)', with the totals."""
        if not self.since_ready:
            return "no group was filtered since the last ready one"
        reasons = ", ".join(
            f"{reason.split(':', 1)[-1] if reason.startswith('filtered:') else reason} {n}"
            for reason, n in sorted(self.since_ready.items(), key=lambda kv: -kv[1])
        )
        rewards = ""
        if self.zero_variance_rewards is not None:
            lo, hi = self.zero_variance_rewards
            rewards = (
                f"; every reward was {lo:g}" if lo == hi else f"; each group's rewards equal, from {lo:g} to {hi:g}"
            )
        return (
            f"the last {self.groups_since_ready} groups were all filtered or failed ({reasons}{rewards}) over"
            f" {self.seconds_since_ready:.0f} s; {self.groups_ready} of {self.groups_resolved} groups ever became ready"
        )

    def advice(self) -> str:
        """What to change, for the most frequent outcome since the last ready group."""
        if not self.since_ready:
            return ""
        top = max(self.since_ready.items(), key=lambda kv: kv[1])[0]
        if top == filters.FILTERED_ZERO_VARIANCE:
            lo, hi = self.zero_variance_rewards or (0.0, 0.0)
            if hi <= 0.0:
                return (
                    "the model never solves these prompts: use easier prompts (data.train_path, data.task), a"
                    " stronger or warm-started model (model.path, model.warm_start_examples), or keep such groups with"
                    " buffer.filter_zero_variance=false (their advantages are 0: no learning signal)"
                )
            if lo == hi:
                return (
                    "every sample of every group earns the same reward: check the reward function (env.reward),"
                    " or use harder prompts (data.train_path, buffer.pass_rate_curriculum)"
                )
            return "every group's samples earn equal rewards: use more samples per prompt (rollout.samples_per_prompt)"
        if top == filters.FILTERED_OVERLONG:
            return "every sample was cut at rollout.max_tokens: raise it, or set buffer.filter_overlong=false"
        if top == filters.FILTERED_STRAGGLER:
            return "groups did not finish within buffer.group_timeout_s: raise it, or check the engines"
        if top == filters.FILTERED_TOO_FEW_MEMBERS:
            return "groups kept fewer than 2 usable samples: see why samples failed (the failed:* counters)"
        return f"every sample failed ({top}): the rollout workers' errors name the cause (env.reward, the environment)"


def starved_message(starvation: Starvation, waited_s: float) -> str:
    """The text of the `StarvedError` raised after `waited_s` seconds without a batch."""
    return f"no batch in {waited_s:.0f} s: {starvation.describe()} — {starvation.advice()}"


class GroupOutcomes:
    """The queue's record of how its groups were resolved (`Starvation`), on the queue's clock."""

    def __init__(self, now: float) -> None:
        self.resolved = 0
        self.ready = 0
        self.since_ready: Counter[str] = Counter()
        self.zero_variance_rewards: tuple[float, float] | None = None
        self.last_ready_at = now

    def record(self, outcome: str, now: float, reward: float = 0.0) -> None:
        """One group resolved as `outcome` (`READY` or a terminal state); `reward` is a zero-variance group's."""
        self.resolved += 1
        if outcome == READY:
            self.ready += 1
            self.since_ready.clear()
            self.zero_variance_rewards = None
            self.last_ready_at = now
            return
        self.since_ready[outcome] += 1
        if outcome == filters.FILTERED_ZERO_VARIANCE:
            lo, hi = self.zero_variance_rewards or (reward, reward)
            self.zero_variance_rewards = (min(lo, reward), max(hi, reward))

    def snapshot(self, now: float) -> Starvation:
        return Starvation(
            self.resolved, self.ready, dict(self.since_ready), self.zero_variance_rewards, now - self.last_ready_at
        )
