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

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from asyncrl.buffer import filters
from asyncrl.buffer.groups import ARRIVED, OUT, PENDING, READY, GroupBook, GroupState, Member, MemberState
from asyncrl.buffer.ledger import ConservationError, ResponseLengths
from asyncrl.buffer.starvation import Starvation
from asyncrl.types import Batch, Exchange, Prompt, Request, Trajectory

__all__ = ["ConservationError", "Member", "MemberState", "ReplayQueueCore"]


class ReplayQueueCore(GroupBook):
    """Admission, readiness, filters, staleness check and conservation counters of the replay queue, on the
    books of `groups.GroupBook` (its constructor: config, batch_groups, clock, log_dir, log_store).
    """

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

    def hold_admission(self, held: bool) -> None:
        """Start no new group while `held` (members of started groups are still handed out): the engines serve a
        blocking evaluation alone."""
        self.admission_held = held

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
        touched: dict[str, GroupState] = {}
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
                self._resolve(g, [], empty_fate=filters.FILTERED_STRAGGLER)
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

    def starvation(self) -> Starvation:
        """How groups were resolved, in all and since the last ready one (`starvation.Starvation`)."""
        return self.outcomes.snapshot(self.clock())

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
        `ready_hold` (1 while prompts wait because of it), `groups_ahead`, `ready_groups`, `ready_samples`,
        `groups_in_flight`, `backlog_groups`,
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
    # Internals: admission.

    def _can_start(self) -> bool:
        if not self._backlog or self.admission_held:
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
        self._groups[gid] = GroupState(
            gid, prompt, [Member() for _ in range(size)], start_version=self.admission_version
        )
        self._pending.extend((gid, i) for i in range(size))
        self._unresolved += 1
        self.ledger.dispatch(size)
        self.ledger.count("groups_started")
        return True
