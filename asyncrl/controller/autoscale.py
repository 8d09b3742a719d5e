"""Autoscaling the rollout pool (`rollout.autoscale`) from the figures of each pool snapshot.

Grow by one engine while the learner waits for data (`live.learner_idle_fraction` >= `grow_learner_idle`); shrink
by one while it does not (<= `shrink_learner_idle`, lower: hysteresis) and finished samples pile up (ready groups
>= `shrink_ready_batches` batches, or engines idle >= `shrink_rollout_idle` of the window because the queue holds
starts back) or go stale (`live.stale_drop_fraction` >= `shrink_stale_fraction`). A
condition must hold for `sustain` snapshots in a row, and after a change (or the run's start) nothing changes for
`cooldown_s` from when no engine is joining any more (`hold`), so the new size's figures fill the rate window
first. The decision goes to the job's control like `asyncrl scale` (`Fleet.autoscale`).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.rollout import AutoscaleConfig
from asyncrl.telemetry.sinks import PoolSnapshot

__all__ = ["Autoscaler", "Decision", "Figures"]


@dataclass(frozen=True)
class Figures:
    """What the policy reads of one pool snapshot."""

    wall_s: float
    learner_idle: float
    stale_drop: float
    ready_batches: float
    """Groups ready in the queue over the groups of one batch."""
    rollout_idle: float = 0.0
    """The fraction of the window the engines sat idle (the queue held starts back: enough groups ready)."""

    @classmethod
    def of(cls, snapshot: PoolSnapshot) -> Figures:
        live, queue = snapshot.live, snapshot.queue
        batch = queue.get("batch_groups") or 1
        return cls(
            wall_s=snapshot.wall_s,
            learner_idle=live.learner_idle_fraction if live else 0.0,
            stale_drop=live.stale_drop_fraction if live else 0.0,
            ready_batches=queue.get("ready_groups", 0) / batch,
            rollout_idle=live.rollout_idle_fraction if live else 0.0,
        )


@dataclass(frozen=True)
class Decision:
    size: int
    reason: str


class Autoscaler:
    """`decide(size, figures)` -> a new size for the pool, or None. Holds the streaks and the last change."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.last_change_s = 0.0
        """The run's clock (`wall_s`) at the last change; the start counts as one."""
        self._grow = self._shrink = 0
        """Snapshots in a row that asked to grow / to shrink."""

    def decide(self, size: int, figures: Figures) -> Decision | None:
        c = self.config
        grow = figures.learner_idle >= c.grow_learner_idle
        piled = (
            figures.ready_batches >= c.shrink_ready_batches
            or figures.rollout_idle >= c.shrink_rollout_idle
            or figures.stale_drop >= c.shrink_stale_fraction
        )
        shrink = figures.learner_idle <= c.shrink_learner_idle and piled
        self._grow, self._shrink = (self._grow + 1) * grow, (self._shrink + 1) * shrink
        if figures.wall_s - self.last_change_s < c.cooldown_s:
            return None
        if size < c.min or size > c.max:  # e.g. resized by hand past a bound: back inside, one step at a time
            return self._change(figures, size + (1 if size < c.min else -1), f"outside [{c.min}, {c.max}]")
        if self._grow >= c.sustain and size < c.max:
            idle = f"learner idle {figures.learner_idle:.0%} >= {c.grow_learner_idle:.0%}"
            return self._change(figures, size + 1, idle)
        if self._shrink >= c.sustain and size > c.min:
            what = (
                f"{figures.ready_batches:.1f} batches ready"
                if figures.ready_batches >= c.shrink_ready_batches
                else f"engines idle {figures.rollout_idle:.0%}"
                if figures.rollout_idle >= c.shrink_rollout_idle
                else f"{figures.stale_drop:.0%} dropped stale"
            )
            return self._change(figures, size - 1, f"learner idle {figures.learner_idle:.0%}, {what}")
        return None

    def hold(self, wall_s: float) -> None:
        """A change is still settling at `wall_s` (an engine joining): the cool-down starts again from now."""
        self.last_change_s = max(self.last_change_s, wall_s)

    def _change(self, figures: Figures, size: int, reason: str) -> Decision:
        self.last_change_s, self._grow, self._shrink = figures.wall_s, 0, 0
        return Decision(size, reason)
