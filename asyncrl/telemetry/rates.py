"""Live rates from the cumulative figures of pool snapshots: what moved over the last few seconds.

A snapshot's counters only grow (tokens generated, busy seconds, samples dropped), so a rate over a window is
(newest - oldest) / elapsed between two snapshots. The window starts from an all-zero point at the run's start,
so the first snapshots already give rates. A replaced engine takes its counts with it; a window that spans
the replacement undercounts (never below 0) until it has moved past it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.telemetry.sinks import LiveRates, PoolSnapshot


@dataclass(frozen=True)
class _Point:
    """The cumulative figures of one snapshot that rates are taken of."""

    wall_s: float = 0.0
    generated: float = 0.0
    trained: float = 0.0
    rollout_busy_s: float = 0.0
    rollout_idle_s: float = 0.0
    learner_wait_s: float = 0.0
    dropped_stale: float = 0.0
    finished: float = 0.0
    """Samples that reached a terminal state (trained, dropped, filtered or failed)."""


def _point(snapshot: PoolSnapshot) -> _Point:
    counters = snapshot.counters
    finished = sum(
        n
        for state, n in counters.items()
        if state in ("trained", "dropped_stale") or state.startswith(("filtered:", "failed:"))
    )
    return _Point(
        wall_s=snapshot.wall_s,
        generated=snapshot.engine_total("tokens_generated"),
        trained=snapshot.tokens_trained,
        rollout_busy_s=snapshot.engine_total("busy_s"),
        rollout_idle_s=snapshot.engine_total("idle_s"),
        learner_wait_s=snapshot.learner_wait_s,
        dropped_stale=counters.get("dropped_stale", 0),
        finished=finished,
    )


def _ratio(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0


class RateWindow:
    """Keeps the snapshots of the last `window_s` seconds (and the one just before, so the window is full)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.points: deque[_Point] = deque([_Point()])

    def add(self, snapshot: PoolSnapshot) -> LiveRates:
        """Rates from the oldest kept snapshot to `snapshot`."""
        now = _point(snapshot)
        self.points.append(now)
        while len(self.points) > 2 and now.wall_s - self.points[1].wall_s >= self.window_s:
            self.points.popleft()
        first = self.points[0]
        elapsed = now.wall_s - first.wall_s

        def delta(name: str) -> float:
            return max(0.0, getattr(now, name) - getattr(first, name))

        busy, idle = delta("rollout_busy_s"), delta("rollout_idle_s")
        return LiveRates(
            window_s=elapsed,
            generated_tokens_per_s=delta("generated") / elapsed if elapsed > 0 else 0.0,
            trained_tokens_per_s=delta("trained") / elapsed if elapsed > 0 else 0.0,
            rollout_idle_fraction=_ratio(idle, busy + idle),
            learner_idle_fraction=_ratio(delta("learner_wait_s"), elapsed),
            stale_drop_fraction=_ratio(delta("dropped_stale"), delta("finished")),
        )
