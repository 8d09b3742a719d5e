"""The weight-sync contract, shared by every transport (Ray object store, shared memory; NCCL on GPU).

A sync has two halves so that the learner can go on while the engines load: `start(version)` exports the
learner's current weights and starts every engine loading them; `finish(pending)` waits until every engine
confirms the version and raises naming each one that did not (invariant 7). At most one sync is in flight,
so engines take versions in order. `latest()` is what an engine started later loads before it serves.

The controller owns the version and passes it in. When to overlap a sync with the next learner step and
when to probe log-prob parity is policy, decided here from `WeightSyncConfig` and the run's mode, so that
every transport applies it alike.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.weights.published import PublishedWeights

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig

__all__ = ["PendingSync", "SyncResult", "WeightSync"]


@dataclass(frozen=True)
class PendingSync:
    """A weight sync sent to the engines and not yet confirmed."""

    weights: PublishedWeights
    calls: dict[Any, str]
    """Object ref of each engine's load call -> the worker's name."""
    began: float
    """`time.time()` when the export began."""
    export: Any = None
    """The learner's export call when the sync did not wait for it (`LearnerCall`; None: it was waited for).
    `finish` collects it first, so that a failed export is named by learner rank."""

    @property
    def version(self) -> int:
        return self.weights.version

    def confirmed(self, served_at: float | None) -> SyncResult:
        """The record of this sync, now that every engine confirmed it; `served_at`: when the last engine began
        serving it (`RolloutPool.finish_update`; None: now). Engines on other nodes stamp it with their own
        clocks: it is kept between the export's start and now."""
        w, now = self.weights, time.time()
        ended = now if served_at is None else min(max(served_at, self.began), now)
        return SyncResult(w.version, ended - self.began, w.num_bytes, w.num_tensors, w.num_buckets)


@dataclass(frozen=True)
class SyncResult:
    """A completed sync: every engine serves `version`."""

    version: int
    seconds: float
    """From the start of the export to the moment the last engine began serving the version (not to the moment
    the controller collected the confirmations: with `weight_sync.overlap` that is after its next step)."""
    num_bytes: int
    num_tensors: int
    num_buckets: int


class WeightSync(ABC):
    """Moves the learner's weights to every engine. Not thread-safe; call from the controller's thread."""

    def __init__(self, config: WeightSyncConfig, mode: Mode):
        self.config = config
        self.in_flight = config.in_flight and mode != "sync"
        """Engines load without draining running requests (never in `sync` mode: it is on-policy)."""

    @abstractmethod
    def start(self, version: int, in_flight: bool | None = None) -> PendingSync:
        """Export the learner's current weights as `version` and start every engine loading them.
        `in_flight=None` follows the policy (`self.in_flight`); False drains running requests first."""

    @abstractmethod
    def finish(self, pending: PendingSync) -> SyncResult:
        """Wait until every engine of `pending` serves its version; raise naming each engine that failed
        or did not confirm within `config.timeout_s`."""

    @abstractmethod
    def latest(self) -> PublishedWeights | None:
        """The last weights started (None before the first): an engine started later loads them first."""

    @abstractmethod
    def rewire(self, learner: Any, version: int) -> None:
        """Publish from `learner` from now on (a re-formed learner pool, `Controller._resize_learner`): stage
        `version`, which every engine already serves, from it and make that `latest()`, so that an engine that
        joins later loads weights the new pool holds (the old rank 0 owned the object refs, wrote the segment or
        held the staging buffer). No engine loads anything; an engine's next pull opens a group with the new
        rank 0 (a new store address)."""

    def shutdown(self) -> None:  # noqa: B027 -- optional hook: most transports hold nothing to release
        """Release what the transport holds outside the engines and the learner (shared-memory segments)."""

    def overlaps(self) -> bool:
        """Whether the learner may start its next step before the engines confirm a sync."""
        return self.in_flight and self.config.overlap

    def probes(self, version: int) -> bool:
        """Whether to check engine-learner log-prob parity after the sync of `version` (the first one, then
        every `parity_probe_every`-th)."""
        return self.config.parity_probe and (version == 1 or version % self.config.parity_probe_every == 0)
