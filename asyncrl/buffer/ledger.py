"""The replay queue's books: where every dispatched sample ended, and what the trained ones looked like.

Kept apart from `core.py` so that the conservation law (invariant 3) reads in one place:

    dispatched == trained + dropped_stale + Σ filtered:* + Σ failed:* + in_flight

The core tells the ledger when samples are dispatched and when one reaches its terminal state; the ledger
counts, checks the law, and keeps the staleness histogram and put-to-get latencies of trained samples, and
the response lengths of generated and of trained samples (a staleness policy that drops long samples shows as
a gap between the two).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.types import DROPPED_STALE, TRAINED

LATENCY_WINDOW = 100_000
"""Put-to-get latencies kept for the percentiles (the most recent ones)."""

ALWAYS_COUNTED = (
    "dispatched",
    TRAINED,
    DROPPED_STALE,
    "acquired",
    "put",
    "stale_attempt",
    "requeued",
    "retired_prompts",
    "skipped_retired",
    "straggler_groups",
    "groups_started",
    "groups_consumed",
    "groups_dropped_stale",
    "stale_samples_masked",
    "stale_tokens_masked",
)
"""Keys `counters()` always reports (0 when nothing happened), so readers need no `.get(key, 0)`."""


@dataclass(frozen=True)
class LengthStats:
    """Response lengths (tokens) of a set of samples. Percentiles are nearest-rank: `p50` is the smallest length
    that at least half of the samples do not exceed. All zero for no samples."""

    count: int = 0
    mean: float = 0.0
    p50: int = 0
    p90: int = 0
    max: int = 0

    @classmethod
    def from_histogram(cls, histogram: Counter[int]) -> LengthStats:
        count = sum(histogram.values())
        if not count:
            return cls()
        lengths = sorted(histogram)
        cumulative = np.cumsum([histogram[n] for n in lengths])

        def rank(q: float) -> int:
            return lengths[int(np.searchsorted(cumulative, q * count))]

        mean = sum(n * k for n, k in histogram.items()) / count
        return cls(count=count, mean=mean, p50=rank(0.5), p90=rank(0.9), max=lengths[-1])


@dataclass(frozen=True)
class ResponseLengths:
    """Response lengths of every sample that finished generation (`generated`: reached the queue without a
    failure, whatever its fate) and of the samples handed to the learner (`trained`).

    A policy that drops long samples shows as `trained` below `generated`. Samples still ready when a run
    ends count as generated only; short ones finish first, so at the end `generated` may sit a little below
    `trained` even when nothing was dropped. Requests aborted as stale never finish and are in neither."""

    generated: LengthStats
    trained: LengthStats


class ConservationError(AssertionError):
    """dispatched != trained + dropped_stale + filtered + failed + in_flight, or in_flight disagrees with the
    members."""


class Ledger:
    """Counters, the conservation check, the staleness histogram and latencies of one replay queue."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.in_flight = 0
        """Samples dispatched and not yet terminal."""
        self.staleness: Counter[int] = Counter()
        """Lag (learner version - the sample's min_version) -> trained samples."""
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.generated_lengths: Counter[int] = Counter()
        """Response length -> samples that finished generation."""
        self.trained_lengths: Counter[int] = Counter()
        """Response length -> trained samples."""

    def count(self, key: str, n: int = 1) -> None:
        """An informational counter (not part of the conservation sum)."""
        self.counts[key] += n

    def dispatch(self, samples: int) -> None:
        self.counts["dispatched"] += samples
        self.in_flight += samples

    def finish(self, fate: str) -> None:
        """One sample reaches its terminal state `fate`."""
        self.counts[fate] += 1
        self.in_flight -= 1

    def record_generated(self, response_lengths: Sequence[int]) -> None:
        """Samples that finished generation (they reached the queue without a failure), all of one put at once."""
        self.generated_lengths.update(response_lengths)

    def record_trained(
        self, lags: Sequence[int], latencies_s: Sequence[float], response_lengths: Sequence[int]
    ) -> None:
        """Samples handed to the learner, the k-th with `lags[k]`, `latencies_s[k]` after it was put (their fates are
        counted by `finish`). A whole batch at once: three C-level bulk updates where a call per sample cost more."""
        self.staleness.update(lags)
        self.latencies.extend(latencies_s)
        self.trained_lengths.update(response_lengths)

    def response_lengths(self) -> ResponseLengths:
        return ResponseLengths(
            LengthStats.from_histogram(self.generated_lengths), LengthStats.from_histogram(self.trained_lengths)
        )

    def counters(self) -> dict[str, int]:
        out = dict.fromkeys(ALWAYS_COUNTED, 0)
        out.update(self.counts)
        out["in_flight"] = self.in_flight
        return out

    def check(self, members_in_flight: int) -> dict[str, int]:
        """Raise `ConservationError` unless invariant 3 holds and the in-flight counter matches the
        `members_in_flight` the queue sees; returns the counters."""
        c = self.counters()
        filtered = sum(v for k, v in c.items() if k.startswith("filtered:"))
        failed = sum(v for k, v in c.items() if k.startswith("failed:"))
        rhs = c[TRAINED] + c[DROPPED_STALE] + filtered + failed + c["in_flight"]
        if c["dispatched"] != rhs:
            raise ConservationError(
                f"replay queue: dispatched {c['dispatched']} != trained {c[TRAINED]} + dropped_stale {c[DROPPED_STALE]}"
                f" + filtered {filtered} + failed {failed} + in_flight {c['in_flight']} (= {rhs}); counters {c}"
            )
        if members_in_flight != self.in_flight:
            raise ConservationError(
                f"replay queue: in_flight counter {self.in_flight} != {members_in_flight} members not yet terminal"
            )
        return c

    def staleness_histogram(self) -> dict[int, int]:
        return dict(sorted(self.staleness.items()))

    def staleness_stats(self) -> dict[str, float]:
        """`staleness_mean`, `staleness_max` (policy versions) and `staleness_hist:<lag>` of the trained samples."""
        total = sum(self.staleness.values())
        out: dict[str, float] = {
            "staleness_mean": sum(lag * n for lag, n in self.staleness.items()) / total if total else 0.0,
            "staleness_max": max(self.staleness, default=0),
        }
        for lag, n in sorted(self.staleness.items()):
            out[f"staleness_hist:{lag}"] = n
        return out

    def latency_stats(self) -> dict[str, float]:
        """Put-to-get seconds of the most recent trained samples: count, mean, p50, p99, max."""
        if not self.latencies:
            return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        values = np.fromiter(self.latencies, dtype=np.float64)
        p50, p99 = np.percentile(values, [50, 99])
        return {
            "count": len(values),
            "mean": float(values.mean()),
            "p50": float(p50),
            "p99": float(p99),
            "max": float(values.max()),
        }

    def state_dict(self, redispatched_groups: int) -> dict[str, Any]:
        """Counters and histogram for a checkpoint. The samples in flight, and the `redispatched_groups` they
        belong to, leave `dispatched` and `groups_started`: the restored queue dispatches them anew."""
        counts = Counter(self.counts)
        counts["dispatched"] -= self.in_flight
        counts["groups_started"] -= redispatched_groups
        return {
            "counters": {k: v for k, v in counts.items() if v},
            "staleness": dict(self.staleness),
            "generated_lengths": dict(self.generated_lengths),
            "trained_lengths": dict(self.trained_lengths),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (JSON round-tripped keys welcome); nothing is in flight afterwards."""
        self.counts = Counter({k: int(v) for k, v in state["counters"].items()})
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        # Checkpoints written before the length histograms existed have neither key.
        self.generated_lengths = Counter({int(k): int(v) for k, v in state.get("generated_lengths", {}).items()})
        self.trained_lengths = Counter({int(k): int(v) for k, v in state.get("trained_lengths", {}).items()})
        self.in_flight = 0
