"""The staleness bound η (`buffer.max_staleness`) and every question the system asks of it.

A sample's lag is the learner version of the step that trains it minus the oldest policy version that
produced one of its tokens (its `min_version`). No trained token may have lag > η. The queue's admission,
its hand-out, the engines' abort, the controller's prompt supply and the benchmark replays all ask this
object rather than spell the comparison themselves, so the rule has one owner.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Staleness"]


@dataclass(frozen=True)
class Staleness:
    """η, the largest policy lag (in versions) allowed in a gradient; 0 is on-policy."""

    eta: int

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"max_staleness must be >= 0 (got {self.eta})")

    @property
    def synchronous(self) -> bool:
        """η == 0: every sample is trained at the version that generated it, so a step's groups may start
        only once the engines serve that step's weights (the controller finishes each sync before waiting)."""
        return self.eta == 0

    def trainable(self, min_version: int, learner_version: int) -> bool:
        """A sample (or group) whose oldest token is from `min_version` may be trained by a step at
        `learner_version`: lag = learner_version - min_version <= η."""
        return learner_version - min_version <= self.eta

    def oldest_trainable_version(self, learner_version: int) -> int:
        """The oldest token version a step at `learner_version` may train: learner_version - η. A token with
        version < this has lag > η (`stale_policy: continue` masks it out of the loss)."""
        return learner_version - self.eta

    def last_chance(self, start_version: int, learner_version: int) -> bool:
        """A step at `learner_version` is the last one that may train a group started at admission version
        `start_version` (whose samples have min_version >= start_version): learner_version - start_version >= η.
        Under `stale_policy: wait` that step waits for the group."""
        return learner_version - start_version >= self.eta

    def certain_to_exceed(self, first_version: int, served_version: int) -> bool:
        """A running request whose first token came while its engine served `first_version` will have lag > η
        at any step that could train it, since that step runs at a version >= `served_version`, the one its
        engine serves now: served_version - first_version > η. Engines abort such requests (`stale_policy: drop`)."""
        return served_version - first_version > self.eta

    def admission_limit(self, admission_version: int, batch_groups: int) -> int:
        """Groups that may have been started (consumed + in flight + ready) while the engines serve
        `admission_version`: (admission_version + η + 1) * batch_groups. Group n (0-based) is admitted when
        n + 1 <= this: the last group it admits is trained at step admission_version + η at the latest."""
        return (admission_version + self.eta + 1) * batch_groups

    def prompts_ahead(self, prompts_per_step: int) -> int:
        """Prompts to keep queued so the engines can run the whole admission window and one batch more:
        (η + 2) * prompts_per_step."""
        return (self.eta + 2) * prompts_per_step
