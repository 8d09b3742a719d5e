"""The seam between what a run measures and who shows it.

The controller reports every event once, to one `Telemetry`; it fans the event out to each `Sink` (the console
progress view, the Prometheus exporter, the dashboard page, TensorBoard/W&B). A sink that raises is reported once
and then skipped: showing a run never stops it.

Events (all plain, JSON-able data):
- `phase(text)`: start-up and shutdown phases ("building the model", "starting 2 engines").
- `step(row)`: one finished optimizer step, the same dict that is appended to `metrics.jsonl`;
  `row["lag_counts"]` maps each policy lag (as a string) to its sample count.
- `eval(record)`: one held-out evaluation (the records of `summary.json`'s `evals`).
- `sync(event)`: a weight sync every engine confirmed (`SyncEvent`).
- `pool(snapshot)`: queue, engine and throughput state, every `telemetry.pool_every_s` seconds (`PoolSnapshot`).
- `note(text)`: something a user should see (a replaced engine, a stop request).
- `alarm(event)`: a configured threshold crossed, or back within it (`AlarmEvent.active`).
- `close(summary)`: the run ended; `summary` is what `summary.json` holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SyncEvent:
    version: int
    seconds: float
    """Learner step done to every engine serving `version`."""
    parity: float | None = None
    """Max |engine - learner| log-prob on the probe sequence, when this sync was probed."""
    bytes: int = 0


@dataclass(frozen=True)
class LiveRates:
    """Rates over the recent snapshots (`telemetry.rate_window_s`), so live views move while the run goes on."""

    window_s: float
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    rollout_idle_fraction: float
    """Idle seconds of all engines over their busy + idle seconds."""
    learner_idle_fraction: float
    """Seconds the learner waited for a batch over the window."""
    stale_drop_fraction: float
    """Samples dropped as stale over all samples that reached a terminal state in the window."""


@dataclass(frozen=True)
class PoolSnapshot:
    """The run's state at one moment; counters are cumulative since the run began."""

    wall_s: float
    version: int
    counters: dict[str, int]
    """The queue's conservation counters (`dispatched`, `trained`, `filtered:<reason>`, ...)."""
    queue: dict[str, float]
    """The queue's level figures (`ReplayQueue.stats()`: ready, backlog, in-flight groups, ...)."""
    engines: dict[str, dict[str, Any]]
    """Per serving rollout worker: `RolloutWorker.stats()` (version, tokens generated, busy/idle seconds, ...)."""
    tokens_trained: int = 0
    learner_wait_s: float = 0.0
    pool_sizes: dict[str, int] = field(default_factory=dict)
    """Live and joining workers per pool, e.g. {"rollout": 2, "rollout_joining": 1, "learner": 1}."""
    live: LiveRates | None = None
    """Throughput and idle fractions over the last `telemetry.rate_window_s` (None: not measured)."""
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per rollout worker that died or was removed: the last `stats()` it reported (`RolloutPool.retired`)."""

    def engine_total(self, key: str) -> float:
        """A rollout worker counter (`tokens_generated`, `busy_s`, ...) summed over every worker of the run so far,
        serving or retired: it never steps back when an engine dies and its replacement counts from zero."""
        return sum(e.get(key, 0) for e in (*self.engines.values(), *self.retired.values()))


@dataclass(frozen=True)
class AlarmEvent:
    name: str
    value: float
    threshold: float
    message: str
    stop: bool = False
    """The alarm is configured to stop the run (cleanly, with a checkpoint)."""
    active: bool = True
    """True when the figure crossed the threshold, False when it came back within it (the alarm cleared)."""


class Sink:
    """Base class of every sink; each hook is optional."""

    def phase(self, text: str) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def eval(self, record: dict[str, Any]) -> None: ...

    def sync(self, event: SyncEvent) -> None: ...

    def pool(self, snapshot: PoolSnapshot) -> None: ...

    def note(self, text: str) -> None: ...

    def alarm(self, event: AlarmEvent) -> None: ...

    def close(self, summary: dict[str, Any]) -> None: ...


class Telemetry(Sink):
    """Fans every event out to its sinks; a sink that raises is named once on stderr and dropped."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)

    def _fan_out(self, hook: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, hook)(*args)
            except Exception as e:  # noqa: BLE001 - a display must never stop the run
                print(
                    f"[telemetry] {type(sink).__name__}.{hook} failed and is disabled: {type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                self.sinks.remove(sink)

    def phase(self, text: str) -> None:
        self._fan_out("phase", text)

    def step(self, row: dict[str, Any]) -> None:
        self._fan_out("step", row)

    def eval(self, record: dict[str, Any]) -> None:
        self._fan_out("eval", record)

    def sync(self, event: SyncEvent) -> None:
        self._fan_out("sync", event)

    def pool(self, snapshot: PoolSnapshot) -> None:
        self._fan_out("pool", snapshot)

    def note(self, text: str) -> None:
        self._fan_out("note", text)

    def alarm(self, event: AlarmEvent) -> None:
        self._fan_out("alarm", event)

    def close(self, summary: dict[str, Any]) -> None:
        self._fan_out("close", summary)


def lag_counts(lags: list[int]) -> dict[str, int]:
    """{"0": n0, "1": n1, ...}: a step's staleness histogram in a JSON-able form."""
    counts: dict[str, int] = {}
    for lag in lags:
        counts[str(lag)] = counts.get(str(lag), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
