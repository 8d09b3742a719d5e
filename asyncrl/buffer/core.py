"""The staleness-bounded replay queue as a plain, deterministic Python object (no Ray, no asyncio).

`ReplayQueueCore` sits between the rollout pool and the learner. The Ray actor in `actor.py` wraps it and
adds waiting; everything that decides *what happens to a sample* lives here, driven by an injectable clock
so that tests can replay any interleaving.

Life of a sample (the unit of counting is one trajectory; a group's fate applies to all its members):

    backlog ──admission──▶ pending ──acquire──▶ out (a worker holds it) ──put──▶ arrived ──group done──▶ ready
                              ▲                   │ requeue_worker                                        │ get_batch
                              └───────────────────┘                                                       ▼
                                                         terminal: trained | dropped_stale | filtered:* | failed:*

Each box is a `MemberState` of the sample's `Member` (PENDING, OUT, ARRIVED, READY; DONE once terminal).
A sample is *dispatched* when its group is admitted (all `samples_per_prompt` members at once) and stays
*in flight* until it reaches a terminal state, so at every moment (invariant 3)

    dispatched == trained + dropped_stale + Σ filtered:* + Σ failed:* + in_flight

The counting itself (counters, the conservation check, the staleness histogram, latencies) is `ledger.Ledger`.

Staleness (invariant 2) is enforced twice. Admission control, as in AReaL: with B groups consumed per
learner step, the n-th group (0-based, in consumption order) is consumed at learner version floor(n / B), so
a group started at version v arrives within the bound iff n + 1 <= (v + eta + 1) * B, where
n = consumed + in flight + ready and v is the *admission version*: the version every engine has confirmed,
set by the controller alone (`set_version`), never raised by the learner version `get_batch` is called at.
Hand-out check: a ready group with lag > eta is dropped, never handed out.
Groups finish out of order (long samples), so some would exceed the bound; `config.stale_policy` decides:

- `wait` (default): the learner waits for them. `get_batch` at learner version L hands out nothing while a
  group started at admission version a <= L - eta is unfinished (step L is its last within the bound: its
  tokens carry versions >= a), and hands out ready groups oldest `min_version` first, so such groups are
  trained at L. Admission keeps what the learner waits for to at most B groups per version in the usual
  case; a group the gate could not save is still dropped at hand-out, never trained over the bound.
- `drop`: the learner never waits; an engine aborts such a request as soon as that is certain and hands it
  in with `failure="stale: ..."` (that drops its group at once), and ready groups too old are dropped.
  Long samples are the ones that outlive eta, so the trained lengths are biased short.
- `continue` (partial rollouts): nothing is aborted and the learner never waits; a long sample goes on under
  each new version (engines update in flight; every token keeps its version and behaviour log-prob). At
  hand-out its tokens older than the bound are masked out of the loss and kept as context, so lags are measured
  over trained tokens only (`Trajectory.min_version`) and stay <= eta; a group with a member that has no token
  left within the bound is dropped as under `drop`.

Either way `ledger.response_lengths()` compares the lengths generated with those trained.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.buffer import filters
from asyncrl.buffer.ledger import ConservationError, Ledger, ResponseLengths
from asyncrl.config import BufferConfig
from asyncrl.staleness import Staleness
from asyncrl.types import DROPPED_STALE, STALE_FAILURE, TRAINED, Batch, Exchange, Group, Prompt, Request, Trajectory

__all__ = ["ConservationError", "Member", "MemberState", "ReplayQueueCore"]


class MemberState(enum.Enum):
    """Where one member of an admitted group is (the boxes of the diagram above). Every state but DONE is in flight."""

    PENDING = "pending"
    OUT = "out"
    ARRIVED = "arrived"
    READY = "ready"
    DONE = "done"


PENDING, OUT, ARRIVED, READY, DONE = MemberState
"""Short names for the states, which this module spells on almost every line."""


@dataclass
class Member:
    """One sample of an admitted group. `holder` is set only while OUT, `trajectory` only while ARRIVED or READY."""

    state: MemberState = MemberState.PENDING
    holder: str | None = None
    attempt: int = 0
    """Bumped each time the sample is re-dispatched, so a late answer of an earlier attempt is recognisable."""
    trajectory: Trajectory | None = None
    min_version: int = 0
    """`trajectory.min_version`, taken once on arrival (a numpy reduction per call)."""
    arrived_at: float = 0.0
    acquired_at: float = 0.0


@dataclass
class _GroupState:
    """One admitted group. Lives until every member is terminal (late members of a dropped group included)."""

    group_id: str
    prompt: Prompt
    members: list[Member]
    rewards_seen: list[float] = field(default_factory=list)
    first_arrival_at: float | None = None
    has_deadline: bool = False
    resolved: bool = False
    """Ready, filtered or dropped as a whole; members still out get `late_fate` when they arrive."""
    late_fate: str = filters.FILTERED_STRAGGLER
    min_version: int = 0
    start_version: int = 0
    """The admission version when the group started: no member's tokens can be older (`stale_policy: wait`)."""

    @property
    def size(self) -> int:
        return len(self.members)

    def indices(self, state: MemberState) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.state is state]

    def count(self, state: MemberState) -> int:
        return sum(1 for m in self.members if m.state is state)

    def in_flight(self) -> int:
        return sum(1 for m in self.members if m.state is not DONE)


class ReplayQueueCore:
    """Admission, readiness, filters, staleness check and conservation counters of the replay queue.

    `clock` (seconds) times straggler deadlines and put-to-get latency; tests pass a fake one. With
    `config.log_parquet` and a `log_dir`, every trajectory that reached the queue is appended with its
    terminal state to `<log_dir>/trajectories.parquet` (samples that never came back have no row).
    """

    def __init__(
        self,
        config: BufferConfig,
        batch_groups: int = 1,
        clock: Callable[[], float] = time.monotonic,
        log_dir: str | Path | None = None,
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1 (got {batch_groups})")
        self.config = config
        self.staleness = Staleness(config.max_staleness)
        """The bound η: admission, the wait gate and the hand-out check all ask it."""
        self.batch_groups = batch_groups
        """B: groups the learner consumes per optimizer step (admission control unit)."""
        self.admission_version = 0
        """The policy version every engine has confirmed (`set_version`, by the controller only); admission
        counts from it. The learner version passed to `get_batch` may run ahead and never moves it."""
        self.clock = clock
        self.ledger = Ledger()
        self._backlog: deque[tuple[Prompt, int]] = deque()
        self._groups: dict[str, _GroupState] = {}
        self._pending: deque[tuple[str, int]] = deque()
        self._ready: deque[_GroupState] = deque()
        self._by_worker: dict[str, set[tuple[str, int]]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._unresolved = 0
        self._next_group = 0
        self._next_step_version: int | None = None
        """The version the learner's next `get_batch` asks at (the last call's, plus one once it handed a batch
        out): whether that step waits for an old group (`_enough_ready`)."""
        threshold = config.pass_rate_threshold if config.pass_rate_curriculum else float("inf")
        self._pass_rate = filters.PassRateTracker(threshold)
        self._log = None
        if config.log_parquet and log_dir is not None:
            from asyncrl.buffer.storage import TrajectoryLog, next_log_path

            self._log = TrajectoryLog(next_log_path(log_dir))

    # ------------------------------------------------------------------------------------------------
    # Controller side: prompts, versions.

    def add_prompts(self, prompts: Sequence[Prompt], samples_per_prompt: int) -> int:
        """Queue prompts for dispatch (one group of `samples_per_prompt` each); returns the backlog size."""
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1 (got {samples_per_prompt})")
        for prompt in prompts:
            if self._pass_rate.is_retired(prompt.prompt_id):
                self.ledger.count("skipped_retired")
            else:
                self._backlog.append((prompt, samples_per_prompt))
        return len(self._backlog)

    def set_version(self, version: int) -> None:
        """The rollout pool now serves `version`; admission opens by B groups per version.

        Call it once the weight sync of `version` is confirmed by every engine: admission assumes that
        requests started from now on carry at least this version.
        """
        if version < self.admission_version:
            raise ValueError(f"policy version went back from {self.admission_version} to {version}")
        self.admission_version = version

    # ------------------------------------------------------------------------------------------------
    # Rollout side: acquire requests, put trajectories, lose workers.

    def acquire(self, worker: str, max_requests: int) -> list[Request]:
        """Up to `max_requests` requests: members of started groups first, then new groups while admitted, each
        whole (`_fits_whole`)."""
        self.expire_stragglers()
        now = self.clock()
        requests: list[Request] = []
        held = self._by_worker.setdefault(worker, set())
        while len(requests) < max_requests:
            item = self._next_pending()
            if item is None:
                if not self._fits_whole(max_requests - len(requests), held) or not self._start_group():
                    break
                continue
            g, i = item
            m = g.members[i]
            m.state, m.holder, m.acquired_at = OUT, worker, now
            held.add((g.group_id, i))
            requests.append(
                Request(
                    request_id=f"{g.group_id}/{i}/{m.attempt}",
                    group_id=g.group_id,
                    sample_index=i,
                    group_size=g.size,
                    prompt=g.prompt,
                    attempt=m.attempt,
                )
            )
        self.ledger.count("acquired", len(requests))
        return requests

    def put(self, trajectories: Sequence[Trajectory]) -> int:
        """Hand finished trajectories to the queue; returns how many were accepted.

        A trajectory is matched to its request by (group_id, sample_index, attempt, worker). One whose
        request was re-dispatched, already answered or aborted is ignored and counted `stale_attempt` (not
        a terminal state: its sample is accounted by the current attempt). An empty `worker` matches any
        holder and `attempt=None` any attempt; with the attempt set, a restarted worker that kept its name
        and re-acquired the same sample is still told apart from its previous life.
        """
        self.expire_stragglers()
        now = self.clock()
        touched: dict[str, _GroupState] = {}
        generated: list[int] = []
        accepted = 0
        for t in trajectories:
            g = self._match(t)
            if g is None:
                self.ledger.count("stale_attempt")
                continue
            accepted += 1
            if t.failure is None:
                generated.append(len(t.response_ids))
            self._arrive(g, t, now)
            touched[g.group_id] = g
        self.ledger.count("put", accepted)
        self.ledger.record_generated(generated)
        for g in touched.values():
            self._after_arrivals(g)
        return accepted

    def put_and_acquire(self, trajectories: Sequence[Trajectory], worker: str, max_requests: int) -> Exchange:
        """`put(trajectories)`, then `acquire(worker, max_requests)`: a worker hands in what finished and takes
        work for the slots that freed, in one call where the actor would otherwise take two. The same books as
        the two calls in that order: the answers are in before more work goes out."""
        accepted = self.put(trajectories)
        return Exchange(accepted, self.acquire(worker, max_requests))

    def requeue_worker(self, worker: str) -> int:
        """Re-dispatch every request `worker` holds (it died); returns how many were re-dispatched.

        Each gets a new attempt number and goes to the front of the dispatch order. Members of groups that
        were already resolved (e.g. dropped as stragglers) take their group's fate instead.
        """
        requeued = 0
        for gid, i in sorted(self._by_worker.pop(worker, set()), reverse=True):
            g = self._groups[gid]
            m = g.members[i]
            m.holder = None
            if g.resolved:
                self._finish(g, i, g.late_fate)
                self._forget_if_done(g)
                continue
            m.state = PENDING
            m.attempt += 1
            self._pending.appendleft((gid, i))
            requeued += 1
        self.ledger.count("requeued", requeued)
        return requeued

    def expire_stragglers(self) -> int:
        """Resolve every group incomplete `group_timeout_s` after its first member arrived; returns how many.

        `drop` ends the whole group `filtered:straggler`; `partial` hands out the arrived members if there are
        at least 2. Members still out stay in flight and take `filtered:straggler` when they arrive.
        """
        now = self.clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, gid = heapq.heappop(self._deadlines)
            g = self._groups.get(gid)
            if g is None or g.resolved:
                continue
            expired += 1
            for i in g.indices(PENDING):
                self._finish(g, i, filters.FILTERED_STRAGGLER)
            arrived = g.indices(ARRIVED)
            if self.config.straggler_policy == "partial" and len(arrived) >= 2:
                self._resolve(g, arrived)
            else:
                self._resolve(g, [])
                for i in arrived:
                    self._finish(g, i, filters.FILTERED_STRAGGLER)
            self._forget_if_done(g)
        self.ledger.count("straggler_groups", expired)
        return expired

    def next_deadline(self) -> float | None:
        """Clock time of the next straggler timeout, so a waiter knows when to look again."""
        while self._deadlines:
            deadline, gid = self._deadlines[0]
            g = self._groups.get(gid)
            if g is not None and not g.resolved:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    # ------------------------------------------------------------------------------------------------
    # Learner side.

    def get_batch(self, num_groups: int, learner_version: int, min_groups: int | None = None) -> Batch | None:
        """Hand out the `num_groups` oldest ready groups for a step at `learner_version`, or None.

        Ready groups with lag `learner_version - min_version > max_staleness` are dropped first
        (`dropped_stale`). With `min_groups`, hands out all ready groups when at least that many are ready
        (for the end of a run). Returns None, handing out nothing, when too few are ready or, under
        `stale_policy: wait`, while `awaited_requests` names any. Under `wait` and `continue` the oldest
        `min_version` goes first; under `continue` tokens past the bound are masked first (`_mask_stale_tokens`).
        The admission version is left alone: only the controller moves it, once engines confirm a sync.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1 (got {num_groups})")
        self.expire_stragglers()
        self._next_step_version = learner_version
        if self.awaited_requests(learner_version):
            return None
        if self.config.stale_policy != "drop":  # the oldest first: the awaited group, or the one with most to mask
            self._ready = deque(sorted(self._ready, key=lambda g: g.min_version))
        if self.config.stale_policy == "continue":
            self._mask_stale_tokens(learner_version)
        self._drop_stale(learner_version)
        if len(self._ready) >= num_groups:
            take = num_groups
        elif min_groups is not None and len(self._ready) >= min_groups:
            take = len(self._ready)
        else:
            return None
        now = self.clock()
        handed = [self._hand_out(self._ready.popleft(), now) for _ in range(take)]
        batch = Batch([group for group, _ in handed], learner_version)
        waited = [seconds for _, latencies in handed for seconds in latencies]
        lengths = [len(t.response_ids) for g in batch.groups for t in g.trajectories]
        self.ledger.record_trained(batch.lags, waited, lengths)
        self.ledger.count("groups_consumed", take)
        self._next_step_version = learner_version + 1
        return batch

    def awaited_requests(self, learner_version: int) -> list[tuple[str, str | None]]:
        """Under `stale_policy: wait`: (request_id, holding worker or None while not yet acquired) of the
        unfinished members of the oldest group a step at `learner_version` must wait for; empty otherwise.

        Groups start in admission-version order, so the oldest unresolved group is the only one to look at.
        """
        if self.config.stale_policy != "wait":
            return []
        oldest = next((g for g in self._groups.values() if not g.resolved), None)
        if oldest is None or not self.staleness.last_chance(oldest.start_version, learner_version):
            return []
        return [
            (f"{oldest.group_id}/{i}/{m.attempt}", m.holder)
            for i, m in enumerate(oldest.members)
            if m.state in (PENDING, OUT)
        ]

    def response_lengths(self) -> ResponseLengths:
        """Response-length distributions of the samples generated and of those trained (`ledger.ResponseLengths`)."""
        return self.ledger.response_lengths()

    def drained(self) -> bool:
        """Nothing more can become ready without new prompts: empty backlog, every group resolved."""
        return self._unresolved == 0 and not self._backlog

    # ------------------------------------------------------------------------------------------------
    # Accounting and metrics (the books are kept by `ledger.Ledger`).

    def counters(self) -> dict[str, int]:
        """Terminal-state counters plus `dispatched` and `in_flight` (see the module docstring).

        Other keys are informational and not part of the conservation sum: `acquired`, `put`,
        `stale_attempt`, `requeued`, `retired_prompts`, `skipped_retired`, `straggler_groups`,
        `groups_started`, `groups_consumed`, `groups_dropped_stale`.
        """
        return self.ledger.counters()

    def check_conservation(self) -> dict[str, int]:
        """Raise `ConservationError` unless invariant 3 holds; returns the counters."""
        return self.ledger.check(sum(g.in_flight() for g in self._groups.values()))

    def admission_limit(self) -> int:
        """Groups that may have been started (consumed + in flight + ready) at the admission version."""
        return self.staleness.admission_limit(self.admission_version, self.batch_groups)

    def backlog_groups(self) -> int:
        """Prompts queued and not yet started as groups."""
        return len(self._backlog)

    def groups_ahead(self) -> int:
        """consumed + in flight + ready groups: the position of the next group in consumption order."""
        return self.ledger.counts["groups_consumed"] + self._unresolved + len(self._ready)

    def staleness_histogram(self) -> dict[int, int]:
        """Lag (learner version - the sample's min_version) -> trained samples."""
        return self.ledger.staleness_histogram()

    def latency_stats(self) -> dict[str, float]:
        """Put-to-get seconds of the most recent trained samples: count, mean, p50, p99, max."""
        return self.ledger.latency_stats()

    def stats(self) -> dict[str, float]:
        """A flat dict of numbers for telemetry: `counters()`, the queue's state (`admission_version`,
        `batch_groups`, `max_staleness`, `admission_limit_groups`, `ready_limit_groups` (0: no cap),
        `ready_hold` (1 while prompts wait because of it), `groups_ahead`, `ready_groups`, `ready_samples`, `groups_in_flight`, `backlog_groups`,
        `retired_prompts_total`), the staleness of
        trained samples (`staleness_mean`, `staleness_max`, `staleness_hist:<lag>`), the mean response length of
        generated and of trained samples (`response_len_{generated,trained}_mean`) and put-to-get latency
        (`latency_count`, `latency_{mean,p50,p99,max}_s`)."""
        out: dict[str, float] = dict(self.counters())
        out.update(
            admission_version=self.admission_version,
            batch_groups=self.batch_groups,
            max_staleness=self.config.max_staleness,
            admission_limit_groups=self.admission_limit(),
            ready_limit_groups=(self.config.max_ready_batches or 0) * self.batch_groups,
            ready_hold=float(bool(self._backlog) and self._enough_ready()),
            groups_ahead=self.groups_ahead(),
            ready_groups=len(self._ready),
            ready_samples=sum(g.count(READY) for g in self._ready),
            groups_in_flight=self._unresolved,
            backlog_groups=self.backlog_groups(),
            retired_prompts_total=len(self._pass_rate.retired),
        )
        out.update(self.ledger.staleness_stats())
        lengths = self.response_lengths()
        out.update(response_len_generated_mean=lengths.generated.mean, response_len_trained_mean=lengths.trained.mean)
        for key, value in self.latency_stats().items():
            out[f"latency_{key}" + ("" if key == "count" else "_s")] = value
        return out

    def outstanding_by_worker(self) -> dict[str, int]:
        return {w: len(items) for w, items in self._by_worker.items() if items}

    def oldest_outstanding(self) -> tuple[str, str, float] | None:
        """(request_id, worker, seconds held) of the request held longest by a worker, for error messages."""
        held = [
            (self._groups[gid].members[i].acquired_at, gid, i, w)
            for w, items in self._by_worker.items()
            for gid, i in items
        ]
        if not held:
            return None
        acquired_at, gid, i, worker = min(held)
        return f"{gid}/{i}/{self._groups[gid].members[i].attempt}", worker, self.clock() - acquired_at

    # ------------------------------------------------------------------------------------------------
    # Checkpointing.

    def state_dict(self) -> dict[str, Any]:
        """Counters, version, pass-rate table and backlog; in-flight and ready groups go back to the backlog.

        Their in-flight samples leave `dispatched` with them, so the restored queue starts with
        in_flight == 0 and conservation holding; on resume they are dispatched again as new groups.
        The admission version is saved under `version` (the key older checkpoints have).
        """
        redispatch = [(g.prompt, g.size) for g in self._groups.values() if g.in_flight() and not self._is_zombie(g)]
        backlog = redispatch + list(self._backlog)
        return {
            **self.ledger.state_dict(redispatched_groups=len(redispatch)),
            "version": self.admission_version,
            "batch_groups": self.batch_groups,
            "next_group": self._next_group,
            "pass_rate": self._pass_rate.state_dict(),
            "backlog": [{"prompt": asdict(p), "samples_per_prompt": n} for p, n in backlog],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; only valid on a queue with nothing in flight."""
        if self._groups:
            raise RuntimeError(f"load_state_dict on a replay queue with {len(self._groups)} groups in flight")
        self.ledger.load_state_dict(state)
        self.admission_version = int(state["version"])
        self.batch_groups = int(state["batch_groups"])
        self._next_group = int(state["next_group"])
        self._pass_rate.load_state_dict(state["pass_rate"])
        self._backlog = deque((Prompt(**item["prompt"]), int(item["samples_per_prompt"])) for item in state["backlog"])

    def close(self) -> None:
        """Flush and close the Parquet log."""
        if self._log is not None:
            self._log.close()

    # ------------------------------------------------------------------------------------------------
    # Internals: arrivals.

    def _match(self, t: Trajectory) -> _GroupState | None:
        """The group whose member is waiting for `t`, or None if `t` answers no request currently out."""
        g = self._groups.get(t.group_id)
        if g is None or not 0 <= t.sample_index < g.size:
            return None
        m = g.members[t.sample_index]
        if (
            m.state is not OUT
            or (t.worker and t.worker != m.holder)
            or (t.attempt is not None and t.attempt != m.attempt)
        ):
            return None
        return g

    def _arrive(self, g: _GroupState, t: Trajectory, now: float) -> None:
        """An accepted trajectory: its member ends at once (late, failed, overlong) or waits for its group."""
        i = t.sample_index
        self._release(g, i)
        if g.first_arrival_at is None:
            g.first_arrival_at = now
        if g.resolved:
            self._finish(g, i, g.late_fate, t)
        elif t.failure is not None and filters.failure_reason(t.failure) == STALE_FAILURE:
            self._drop_group_stale(g, i, t)
        elif t.failure is not None:
            self._finish(g, i, filters.failed_state(t.failure), t)
        else:
            g.rewards_seen.append(float(t.reward))
            if self.config.filter_overlong and filters.is_overlong(t):
                self._finish(g, i, filters.FILTERED_OVERLONG, t)
            else:
                m = g.members[i]
                m.state, m.trajectory, m.min_version, m.arrived_at = ARRIVED, t, t.min_version, now

    def _after_arrivals(self, g: _GroupState) -> None:
        """Resolve a group nobody works on any more; otherwise start its straggler clock."""
        if g.resolved:
            self._forget_if_done(g)
        elif g.count(PENDING) == 0 and g.count(OUT) == 0:
            self._resolve(g, g.indices(ARRIVED))
            self._forget_if_done(g)
        elif not g.has_deadline:
            g.has_deadline = True
            heapq.heappush(self._deadlines, (g.first_arrival_at + self.config.group_timeout_s, g.group_id))

    # ------------------------------------------------------------------------------------------------
    # Internals: admission and member life.

    def _is_zombie(self, g: _GroupState) -> bool:
        """A resolved group kept only for members still out (they will be filtered when they arrive)."""
        return g.resolved and g.count(READY) == 0

    def _can_start(self) -> bool:
        if not self._backlog:
            return False
        if len(self._ready) >= self.config.capacity_groups or self._enough_ready():
            return False
        return self.groups_ahead() + 1 <= self.admission_limit()

    def _enough_ready(self) -> bool:
        """`max_ready_batches` batches are ready and the learner's next step may take them (no wait gate)."""
        cap = self.config.max_ready_batches
        if cap is None or len(self._ready) < cap * self.batch_groups:
            return False
        return self._next_step_version is None or not self.awaited_requests(self._next_step_version)

    def _fits_whole(self, room: int, held: set) -> bool:
        """A new group is handed out whole (its samples reach one engine together: one vLLM request of n = G),
        so it starts only if it fits in `room`; a worker holding nothing gets it anyway (fewer slots than a group)."""
        return not held or (bool(self._backlog) and self._backlog[0][1] <= room)

    def _start_group(self) -> bool:
        while self._backlog and self._pass_rate.is_retired(self._backlog[0][0].prompt_id):
            self._backlog.popleft()
            self.ledger.count("skipped_retired")
        if not self._can_start():
            return False
        prompt, size = self._backlog.popleft()
        gid = f"{prompt.prompt_id}#{self._next_group}"
        self._next_group += 1
        self._groups[gid] = _GroupState(
            gid, prompt, [Member() for _ in range(size)], start_version=self.admission_version
        )
        self._pending.extend((gid, i) for i in range(size))
        self._unresolved += 1
        self.ledger.dispatch(size)
        self.ledger.count("groups_started")
        return True

    def _next_pending(self) -> tuple[_GroupState, int] | None:
        while self._pending:
            gid, i = self._pending.popleft()
            g = self._groups.get(gid)
            if g is not None and g.members[i].state is PENDING:
                return g, i
        return None

    def _release(self, g: _GroupState, i: int) -> None:
        """Forget which worker holds member i."""
        m = g.members[i]
        if m.holder is not None:
            self._by_worker.get(m.holder, set()).discard((g.group_id, i))
            m.holder = None

    def _finish(self, g: _GroupState, i: int, fate: str, arriving: Trajectory | None = None) -> None:
        """Member i reaches its terminal state `fate`; its trajectory (the `arriving` one, else the one it
        holds) is logged with that fate."""
        m = g.members[i]
        trajectory = arriving if arriving is not None else m.trajectory
        m.state, m.trajectory = DONE, None
        self.ledger.finish(fate)
        if trajectory is not None and self._log is not None:
            self._log.append(trajectory, fate)

    # ------------------------------------------------------------------------------------------------
    # Internals: a group's fate.

    def _resolve(self, g: _GroupState, members: list[int]) -> None:
        """The group is finished arriving: update the pass rate, filter it, or make `members` ready."""
        g.resolved = True
        self._unresolved -= 1
        if g.rewards_seen and self._pass_rate.update(g.prompt.prompt_id, g.rewards_seen):
            self.ledger.count("retired_prompts")
        fate = None
        if g.size >= 2 and 0 < len(members) < 2:
            fate = filters.FILTERED_TOO_FEW_MEMBERS
        elif (
            g.size >= 2
            and self.config.filter_zero_variance
            and filters.is_zero_variance([g.members[i].trajectory.reward for i in members])
        ):
            fate = filters.FILTERED_ZERO_VARIANCE
        if fate is not None:
            for i in members:
                self._finish(g, i, fate)
            return
        if members:
            for i in members:
                g.members[i].state = READY
            g.min_version = min(g.members[i].min_version for i in members)
            self._ready.append(g)

    def _hand_out(self, g: _GroupState, now: float) -> tuple[Group, list[float]]:
        """A ready group leaves for the learner: its members end `trained`; returns it with each member's
        seconds since arrival (put-to-get latency)."""
        members = g.indices(READY)
        group = Group(g.group_id, [g.members[i].trajectory for i in members])
        waited = [now - g.members[i].arrived_at for i in members]
        for i in members:
            self._finish(g, i, TRAINED)
        self._forget_if_done(g)
        return group, waited

    def _mask_stale_tokens(self, learner_version: int) -> None:
        """`stale_policy: continue`: in each ready group too old for a step at `learner_version`, mask out of the
        loss every member's tokens sampled more than `max_staleness` versions ago (they stay as context). A group
        with a member that would have no trained token left stays as it is, too old: `_drop_stale` drops it whole."""
        oldest_allowed = self.staleness.oldest_trainable_version(learner_version)
        for g in self._ready:
            if self.staleness.trainable(g.min_version, learner_version):
                continue
            members = [g.members[i] for i in g.indices(READY)]
            trained = [m.trajectory.loss_mask != 0 for m in members]
            stale = [(m.trajectory.versions < oldest_allowed) & mask for m, mask in zip(members, trained)]
            if any(mask.any() and not (mask & ~old).any() for mask, old in zip(trained, stale)):
                continue
            for m, old in zip(members, stale):
                if old.any():
                    t = m.trajectory
                    m.trajectory = t.replace(loss_mask=np.where(old, 0, t.loss_mask).astype(t.loss_mask.dtype))
                    m.min_version = m.trajectory.min_version
                    self.ledger.count("stale_tokens_masked", int(np.count_nonzero(old)))
                    self.ledger.count("stale_samples_masked")
            g.min_version = min(m.min_version for m in members)

    def _drop_stale(self, learner_version: int) -> None:
        fresh: deque[_GroupState] = deque()
        for g in self._ready:
            if self.staleness.trainable(g.min_version, learner_version):
                fresh.append(g)
                continue
            for i in g.indices(READY):
                self._finish(g, i, DROPPED_STALE)
            self.ledger.count("groups_dropped_stale")
            self._forget_if_done(g)
        self._ready = fresh

    def _drop_group_stale(self, g: _GroupState, i: int, t: Trajectory) -> None:
        """Member i was aborted by its engine as certain to exceed the bound: the whole group is
        `dropped_stale` now (members not yet back take that fate when they arrive)."""
        self._finish(g, i, DROPPED_STALE, t)
        for j in g.indices(PENDING) + g.indices(ARRIVED):
            self._finish(g, j, DROPPED_STALE)
        g.resolved, g.late_fate = True, DROPPED_STALE
        self._unresolved -= 1
        self.ledger.count("groups_dropped_stale")

    def _forget_if_done(self, g: _GroupState) -> None:
        if g.resolved and g.in_flight() == 0:
            self._groups.pop(g.group_id, None)
