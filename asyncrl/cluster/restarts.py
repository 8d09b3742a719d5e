"""The restart policy of a pool whose workers are replaced when they die or hang (rollout engines, tool workers).

A worker's replacement takes its *slot* (the name of the first worker of that lineage, e.g. `rollout-0`). Each
slot may be restarted `max_restarts` times; a slot whose worker failed `quarantine_failures` times within
`quarantine_window_s` is crash-looping. Either way the slot is quarantined: its worker is not replaced again,
and the pool runs one worker short. Whether the run can go on with what is left is the owner's call (the
controller stops below `rollout.min_healthy_engines`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

__all__ = ["RestartBudget"]


@dataclass
class RestartBudget:
    """Counts each slot's failures and restarts; `failed` decides whether a failed worker is replaced."""

    max_restarts: int
    quarantine_failures: int
    quarantine_window_s: float
    restarts: collections.Counter[str] = field(default_factory=collections.Counter)
    """Replacements started per slot."""
    quarantined: dict[str, str] = field(default_factory=dict)
    """Slot -> why it is no longer restarted."""
    _failures: dict[str, collections.deque[float]] = field(default_factory=dict)
    _slots: dict[str, str] = field(default_factory=dict)
    """Worker name -> its slot, for workers that replaced another."""

    def slot(self, worker: str) -> str:
        return self._slots.get(worker, worker)

    def failed(self, worker: str, now: float | None = None) -> str | None:
        """Record that `worker` died or hung. -> None when its slot may be restarted (the caller then names the
        replacement with `replaced`), else why the slot is now quarantined."""
        slot = self.slot(worker)
        now = time.monotonic() if now is None else now
        times = self._failures.setdefault(slot, collections.deque())
        times.append(now)
        while now - times[0] > self.quarantine_window_s:
            times.popleft()
        if self.restarts[slot] >= self.max_restarts:
            why = f"its restart budget is spent ({self.max_restarts} restarts)"
        elif len(times) >= self.quarantine_failures:
            why = f"{len(times)} failures within {self.quarantine_window_s:g}s"
        else:
            self.restarts[slot] += 1
            return None
        self.quarantined[slot] = why
        return why

    def replaced(self, worker: str, replacement: str) -> None:
        """`replacement` takes `worker`'s slot."""
        self._slots[replacement] = self.slot(worker)

    def summary(self) -> dict[str, object]:
        """Restarts per slot and the quarantined slots with their reasons (for the run's summary)."""
        return {"restarts": dict(self.restarts), "quarantined": dict(self.quarantined)}
