"""The driver's side of the replay queue: start the actor, then call it through a typed `QueueClient`.

Every call waits with a timeout taken from `QueueTimeouts`, so the controller writes no `ray.get` and no
timeout of its own, and a call that hangs fails with an error naming the call and the queue. Ray is
imported lazily so that importing `asyncrl.buffer` stays cheap for code that only needs the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.buffer.actor import ReplayQueue
from asyncrl.buffer.ledger import ResponseLengths
from asyncrl.buffer.starvation import Starvation
from asyncrl.config import BufferConfig
from asyncrl.remote import Store
from asyncrl.types import Batch, Prompt


@dataclass(frozen=True)
class QueueTimeouts:
    """Seconds the driver waits for each kind of queue call (the actor answers bookkeeping calls at once)."""

    call_s: float = 30.0
    """Bookkeeping: prompts, versions, counters, stats, requeue, close."""
    checkpoint_s: float = 60.0
    """`state_dict` / `load_state_dict`: they carry the whole backlog."""
    batch_grace_s: float = 30.0
    """`get_batch` waits its own `timeout_s` inside the actor; the driver allows this much more on top."""


class QueueCallTimeout(TimeoutError):
    """A call to the replay-queue actor got no answer in time (the actor is stuck, dead, or overloaded)."""


class QueueClient:
    """Typed calls to one replay-queue actor. `handle` is the raw actor handle, for rollout workers and the
    rollout pool, which call `put_and_acquire`, `put` and `requeue_worker` themselves."""

    def __init__(self, handle: Any, name: str, timeouts: QueueTimeouts = QueueTimeouts()) -> None:
        self.handle = handle
        self.name = name
        self.timeouts = timeouts

    def _get(self, call: str, ref: Any, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise QueueCallTimeout(f"ReplayQueue '{self.name}': {call} got no answer within {timeout_s:.1f}s") from e

    def add_prompts(self, prompts: Sequence[Prompt], samples_per_prompt: int) -> int:
        """Queue one group per prompt; returns the backlog size."""
        return self._get(
            "add_prompts", self.handle.add_prompts.remote(prompts, samples_per_prompt), self.timeouts.call_s
        )

    def set_version(self, version: int) -> None:
        """Open admission for `version`: call it only once every engine confirmed the sync of `version`."""
        self._get("set_version", self.handle.set_version.remote(version), self.timeouts.call_s)

    def hold_admission(self, held: bool) -> None:
        """Start no new group while `held` (a blocking evaluation has the engines to itself)."""
        self._get("hold_admission", self.handle.hold_admission.remote(held), self.timeouts.call_s)

    def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float, min_groups: int | None = None
    ) -> Batch:
        """A `Batch` for a step at `learner_version`. Raises `TimeoutError` naming the queue and what it waited
        for when nothing is ready within `timeout_s` (from the actor), or `QueueCallTimeout` if the actor
        does not answer at all."""
        ref = self.handle.get_batch.remote(num_groups, learner_version, timeout_s, min_groups=min_groups)
        return self._get("get_batch", ref, timeout_s + self.timeouts.batch_grace_s)

    def stats(self) -> dict[str, float]:
        """The flat numbers of `ReplayQueueCore.stats` (counters, `backlog_groups`, `ready_groups`,
        `admission_version`, `staleness_mean`, latencies, ...)."""
        return self._get("stats", self.handle.stats.remote(), self.timeouts.call_s)

    def backlog_groups(self) -> int:
        """Prompts queued and not yet started as groups: one number, for the controller's prompt top-up."""
        return self._get("backlog_groups", self.handle.backlog_groups.remote(), self.timeouts.call_s)

    def starvation(self) -> Starvation:
        """How groups were resolved since the last ready one (`starvation.Starvation`): one small record."""
        return self._get("starvation", self.handle.starvation.remote(), self.timeouts.call_s)

    def counters(self) -> dict[str, int]:
        """Terminal-state and informational counters (`ReplayQueueCore.counters`)."""
        return self._get("counters", self.handle.counters.remote(), self.timeouts.call_s)

    def check_conservation(self) -> dict[str, int]:
        """The counters, after the actor checked invariant 3 (raises `ConservationError` if it fails)."""
        return self._get("check_conservation", self.handle.check_conservation.remote(), self.timeouts.call_s)

    def staleness_histogram(self) -> dict[int, int]:
        """Lag -> trained samples."""
        return self._get("staleness_histogram", self.handle.staleness_histogram.remote(), self.timeouts.call_s)

    def response_lengths(self) -> ResponseLengths:
        """Response-length distributions of the samples generated and of those trained."""
        return self._get("response_lengths", self.handle.response_lengths.remote(), self.timeouts.call_s)

    def requeue_worker(self, worker: str) -> int:
        """Re-dispatch what a dead worker held; returns how many requests."""
        return self._get("requeue_worker", self.handle.requeue_worker.remote(worker), self.timeouts.call_s)

    def state_dict(self) -> dict[str, Any]:
        return self._get("state_dict", self.handle.state_dict.remote(), self.timeouts.checkpoint_s)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._get("load_state_dict", self.handle.load_state_dict.remote(state), self.timeouts.checkpoint_s)

    def close(self) -> None:
        """Flush the queue's Parquet log, then end the actor (even if the flush failed)."""
        import ray

        try:
            self._get("close", self.handle.close.remote(), self.timeouts.call_s)
        finally:
            ray.kill(self.handle)


def start_replay_queue(
    config: BufferConfig | None = None,
    batch_groups: int = 1,
    name: str = "replay_queue",
    log_dir: str | Path | None = None,
    log_store: Store | None = None,
    num_cpus: float = 0,
    timeouts: QueueTimeouts = QueueTimeouts(),
) -> QueueClient:
    """Start the queue as a named async Ray actor; returns its client (`.handle` is the actor). `log_dir` (the
    trajectory log's folder) may be an object-store URI, reached with `log_store`."""
    import ray

    actor_cls = ray.remote(ReplayQueue)
    handle = actor_cls.options(name=name, num_cpus=num_cpus, max_concurrency=1000).remote(
        config or BufferConfig(),
        batch_groups=batch_groups,
        name=name,
        log_dir=str(log_dir) if log_dir is not None else None,
        log_store=log_store,
    )
    return QueueClient(handle, name, timeouts)
