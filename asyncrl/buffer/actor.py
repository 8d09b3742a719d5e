"""The replay queue as one async Ray actor: `ReplayQueueCore` plus waiting, each wait with a timeout.

All methods run on the actor's single event loop, so the core needs no locks. Waiters sleep on a
"something changed" event that every mutating call replaces, and wake at least at the next straggler
deadline so that timeouts fire even when no trajectory arrives. This module does not import Ray: the driver
starts the actor and calls it through `client.QueueClient`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.buffer.ledger import ResponseLengths
from asyncrl.buffer.starvation import Starvation
from asyncrl.config import BufferConfig
from asyncrl.remote import Store
from asyncrl.types import Batch, Exchange, Prompt, Request, Trajectory


class ReplayQueue:
    """Async facade of `ReplayQueueCore`; run it as a Ray actor with `client.start_replay_queue`."""

    def __init__(
        self,
        config: BufferConfig,
        batch_groups: int = 1,
        name: str = "replay_queue",
        log_dir: str | Path | None = None,
        log_store: Store | None = None,
    ) -> None:
        self.name = name
        self.core = ReplayQueueCore(
            config, batch_groups=batch_groups, clock=time.monotonic, log_dir=log_dir, log_store=log_store
        )
        self._changed = asyncio.Event()
        self._requeues: dict[str, int] = {}
        """`requeue_worker` calls per worker name: a waiting `acquire` of that worker ends when its count moves."""

    def __repr__(self) -> str:
        # Ray puts this in the errors of this actor's calls.
        return f"ReplayQueue({self.name!r})"

    # ------------------------------------------------------------------------------------------------
    # Waiting.

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float) -> None:
        """Sleep until something changes, the next straggler deadline, or `deadline` (monotonic seconds)."""
        until = deadline
        straggler = self.core.next_deadline()
        if straggler is not None:
            until = min(until, straggler)
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, until - time.monotonic()))
        except TimeoutError:
            pass
        if self.core.expire_stragglers():
            self._notify()

    def _describe(self, learner_version: int) -> str:
        s = self.core.stats()
        outstanding = self.core.outstanding_by_worker()
        holders = ", ".join(f"{w}={n}" for w, n in sorted(outstanding.items(), key=lambda kv: -kv[1])[:8]) or "none"
        oldest = self.core.oldest_outstanding()
        if oldest is not None:
            holders += f" (oldest {oldest[0]} held by {oldest[1]} for {oldest[2]:.1f}s)"
        hint = ""
        awaited = self.core.awaited_requests(learner_version)
        if awaited:
            hint = "; stale_policy wait: this step is the last within max_staleness for " + ", ".join(
                f"{rid} ({'held by ' + worker if worker else 'not yet acquired'})" for rid, worker in awaited
            )
        elif (starvation := self.core.starvation()).groups_since_ready and not s["ready_groups"]:
            hint = f"; {starvation.describe()}: {starvation.advice()}"
        elif s["groups_in_flight"] == 0 and s["backlog_groups"] == 0 and s["ready_groups"] == 0:
            hint = "; nothing in flight and the backlog is empty (were prompts added?)"
        elif s["groups_ahead"] >= s["admission_limit_groups"] and s["backlog_groups"]:
            hint = (
                f"; admission is closed (consumed + in flight + ready = {s['groups_ahead']} >= (admission version +"
                f" max_staleness + 1) * batch_groups = {s['admission_limit_groups']}) until a weight sync is"
                f" confirmed: is batch_groups ({s['batch_groups']}) the number of groups consumed per step?"
            )
        return (
            f"ready groups {s['ready_groups']}, groups in flight {s['groups_in_flight']}, samples in flight "
            f"{s['in_flight']}, backlog groups {s['backlog_groups']}, admission version {s['admission_version']};"
            f" requests held by workers: {holders}{hint}"
        )

    # ------------------------------------------------------------------------------------------------
    # Controller side.

    async def add_prompts(self, prompts: Sequence[Prompt], samples_per_prompt: int) -> int:
        backlog = self.core.add_prompts(prompts, samples_per_prompt)
        self._notify()
        return backlog

    async def set_version(self, version: int) -> None:
        self.core.set_version(version)
        self._notify()

    async def hold_admission(self, held: bool) -> None:
        self.core.hold_admission(held)
        self._notify()

    # ------------------------------------------------------------------------------------------------
    # Rollout side.

    async def acquire(self, worker: str, max_requests: int, timeout_s: float = 0.0) -> list[Request]:
        """Up to `max_requests` requests; waits up to `timeout_s` for at least one (an empty list is not an error).
        Asking for none answers at once. A wait that outlives a `requeue_worker(worker)` ends empty: its caller
        died or was removed, and work handed to it now would be held by no one."""
        deadline = time.monotonic() + timeout_s
        requeues = self._requeues.get(worker, 0)
        while max_requests > 0 and self._requeues.get(worker, 0) == requeues:
            requests = self.core.acquire(worker, max_requests)
            if requests or time.monotonic() >= deadline:
                return requests
            await self._wait_change(deadline)
        return []

    async def put(self, trajectories: Sequence[Trajectory]) -> int:
        """Hand in finished trajectories (`ReplayQueueCore.put`); send a `PackedTrajectories`, which crosses
        from the worker column-wise, rather than a list."""
        accepted = self.core.put(trajectories)
        self._notify()
        return accepted

    async def put_and_acquire(
        self, trajectories: Sequence[Trajectory], worker: str, max_requests: int, timeout_s: float = 0.0
    ) -> Exchange:
        """`put` then `acquire` in one actor call, which halves a worker's calls per trajectory (each Ray call
        costs the caller and this actor far more CPU than the queue's own work on a trajectory)."""
        # Nothing handed in changes nothing: skip the put, whose notify would wake every waiting call for naught.
        accepted = await self.put(trajectories) if len(trajectories) else 0
        return Exchange(accepted, await self.acquire(worker, max_requests, timeout_s))

    async def requeue_worker(self, worker: str) -> int:
        self._requeues[worker] = self._requeues.get(worker, 0) + 1
        requeued = self.core.requeue_worker(worker)
        self._notify()
        return requeued

    # ------------------------------------------------------------------------------------------------
    # Learner side.

    async def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float, min_groups: int | None = None
    ) -> Batch:
        """A `Batch` of `num_groups` ready groups with lag <= max_staleness, waiting up to `timeout_s`.

        With `min_groups`, returns what is ready (at least `min_groups`) once the wait times out or nothing
        more can arrive. Otherwise raises `TimeoutError` naming the queue and what it was waiting on.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            dropped = self.core.ledger.counts["groups_dropped_stale"]
            batch = self.core.get_batch(num_groups, learner_version)
            if batch is not None or self.core.ledger.counts["groups_dropped_stale"] != dropped:
                self._notify()  # fewer groups ahead: admission may have opened for waiting producers
            if batch is not None:
                return batch
            if min_groups is not None and (self.core.drained() or time.monotonic() >= deadline):
                batch = self.core.get_batch(num_groups, learner_version, min_groups=min_groups)
                if batch is not None:
                    self._notify()
                    return batch
            if time.monotonic() >= deadline:
                want = f"{num_groups} groups" if min_groups is None else f"{num_groups} (at least {min_groups}) groups"
                raise TimeoutError(
                    f"ReplayQueue '{self.name}': get_batch waited {time.monotonic() - start:.1f}s "
                    f"(timeout {timeout_s}s) for {want} at learner version {learner_version}: "
                    f"{self._describe(learner_version)}"
                )
            await self._wait_change(deadline)

    async def set_version_and_get_batch(
        self, version: int, num_groups: int, timeout_s: float, min_groups: int | None = None
    ) -> Batch:
        """`set_version(version)`, then `get_batch(num_groups, version, ...)`, in one actor call: for a learner
        that confirms the weight sync of `version` just before it asks for that step's batch."""
        await self.set_version(version)
        return await self.get_batch(num_groups, version, timeout_s, min_groups=min_groups)

    # ------------------------------------------------------------------------------------------------
    # Accounting, metrics, checkpoint.

    async def counters(self) -> dict[str, int]:
        return self.core.counters()

    async def check_conservation(self) -> dict[str, int]:
        return self.core.check_conservation()

    async def stats(self) -> dict[str, float]:
        if self.core.expire_stragglers():
            self._notify()
        return self.core.stats()

    async def backlog_groups(self) -> int:
        """Prompts queued and not yet started: the one figure the controller's prompt top-up needs, without
        the percentiles and histograms `stats` computes. Expires stragglers first, as `stats` does, so a
        controller polling this instead of `stats` keeps the same straggler timing."""
        if self.core.expire_stragglers():
            self._notify()
        return self.core.backlog_groups()

    async def starvation(self) -> Starvation:
        """How groups were resolved since the last ready one: the cheap call a waiting controller polls to tell a
        starved learner (every group filtered) from a slow one. Expires stragglers first, as `stats` does."""
        if self.core.expire_stragglers():
            self._notify()
        return self.core.starvation()

    async def staleness_histogram(self) -> dict[int, int]:
        return self.core.staleness_histogram()

    async def response_lengths(self) -> ResponseLengths:
        return self.core.response_lengths()

    async def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state)
        self._notify()

    async def close(self) -> None:
        self.core.close()
