"""The books of the replay queue: every admitted group and its members, from admission to each member's
terminal state. `ReplayQueueCore` (core.py) builds the queue's operations on them.

Each member is in one `MemberState`: PENDING (admitted, not handed out), OUT (a worker holds it), ARRIVED (its
trajectory is in, its group is not), READY (its group is ready for the learner) or DONE (terminal: trained,
dropped_stale, filtered:* or failed:*). A group is *resolved* once it is ready, filtered or dropped as a whole;
members still out then take its `late_fate` when they arrive.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.buffer import filters
from asyncrl.buffer.ledger import Ledger
from asyncrl.buffer.starvation import READY as READY_OUTCOME
from asyncrl.buffer.starvation import GroupOutcomes
from asyncrl.config import BufferConfig
from asyncrl.remote import Store
from asyncrl.types import DROPPED_STALE, STALE_FAILURE, TRAINED, Group, Prompt, Trajectory

__all__ = ["ARRIVED", "DONE", "OUT", "PENDING", "READY", "GroupBook", "GroupState", "Member", "MemberState"]


class MemberState(enum.Enum):
    """Where one member of an admitted group is (the boxes of the diagram in core.py). Every state but DONE is in
    flight."""

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

    def arrived(self) -> Trajectory:
        """The trajectory of an ARRIVED or READY member."""
        if self.trajectory is None:
            raise RuntimeError(f"a {self.state.value} member holds no trajectory")
        return self.trajectory


@dataclass
class GroupState:
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
    last_fate: str = filters.FILTERED_STRAGGLER
    """The terminal state a member reached last: why a group with no usable member ended."""
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


class GroupBook:
    """The state of the replay queue and the life of its members: arrivals, a group's fate, hand-out, stale drops.

    `clock` (seconds) times straggler deadlines and put-to-get latency; tests pass a fake one. With
    `config.log_parquet` and a `log_dir`, every trajectory that reached the queue is appended with its
    terminal state to `<log_dir>/trajectories.parquet` (samples that never came back have no row); `log_dir` may be
    an object-store URI (`log_store` reaches it): the log is written locally and uploaded when it closes.
    """

    def __init__(
        self,
        config: BufferConfig,
        batch_groups: int = 1,
        clock: Callable[[], float] = time.monotonic,
        log_dir: str | Path | None = None,
        log_store: Store | None = None,
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1 (got {batch_groups})")
        self.config = config
        self.staleness = config.staleness
        """The bound η: admission, the wait gate and the hand-out check all ask it."""
        self.batch_groups = batch_groups
        """B: groups the learner consumes per optimizer step (admission control unit)."""
        self.admission_version = 0
        """The policy version every engine has confirmed (`set_version`, by the controller only); admission
        counts from it. The learner version passed to `get_batch` may run ahead and never moves it."""
        self.admission_held = False
        """Whether no new group starts (`hold_admission`, by the controller while a blocking evaluation runs)."""
        self.clock = clock
        self.ledger = Ledger()
        self.outcomes = GroupOutcomes(clock())
        """How each group was resolved: whether the learner is starved (`starvation.Starvation`)."""
        self._backlog: deque[tuple[Prompt, int]] = deque()
        self._groups: dict[str, GroupState] = {}
        self._pending: deque[tuple[str, int]] = deque()
        self._ready: deque[GroupState] = deque()
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

            self._log = TrajectoryLog(*next_log_path(log_dir, log_store), store=log_store)

    # ------------------------------------------------------------------------------------------------
    # Arrivals.

    def _match(self, t: Trajectory) -> GroupState | None:
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

    def _arrive(self, g: GroupState, t: Trajectory, now: float) -> None:
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

    def _after_arrivals(self, g: GroupState) -> None:
        """Resolve a group nobody works on any more; otherwise start its straggler clock."""
        if g.resolved:
            self._forget_if_done(g)
        elif g.count(PENDING) == 0 and g.count(OUT) == 0:
            self._resolve(g, g.indices(ARRIVED))
            self._forget_if_done(g)
        elif not g.has_deadline and g.first_arrival_at is not None:  # set by the arrival that brought it here
            g.has_deadline = True
            heapq.heappush(self._deadlines, (g.first_arrival_at + self.config.group_timeout_s, g.group_id))

    # ------------------------------------------------------------------------------------------------
    # Member life.

    def _is_zombie(self, g: GroupState) -> bool:
        """A resolved group kept only for members still out (they will be filtered when they arrive)."""
        return g.resolved and g.count(READY) == 0

    def _next_pending(self) -> tuple[GroupState, int] | None:
        while self._pending:
            gid, i = self._pending.popleft()
            g = self._groups.get(gid)
            if g is not None and g.members[i].state is PENDING:
                return g, i
        return None

    def _release(self, g: GroupState, i: int) -> None:
        """Forget which worker holds member i."""
        m = g.members[i]
        if m.holder is not None:
            self._by_worker.get(m.holder, set()).discard((g.group_id, i))
            m.holder = None

    def _finish(self, g: GroupState, i: int, fate: str, arriving: Trajectory | None = None) -> None:
        """Member i reaches its terminal state `fate`; its trajectory (the `arriving` one, else the one it
        holds) is logged with that fate."""
        m = g.members[i]
        trajectory = arriving if arriving is not None else m.trajectory
        m.state, m.trajectory = DONE, None
        g.last_fate = fate
        self.ledger.finish(fate)
        if trajectory is not None and self._log is not None:
            self._log.append(trajectory, fate)

    # ------------------------------------------------------------------------------------------------
    # A group's fate.

    def _resolve(self, g: GroupState, members: list[int], empty_fate: str | None = None) -> None:
        """The group is finished arriving: update the pass rate, filter it, or make `members` ready. With no
        `members`, its outcome is `empty_fate`, else the fate its members reached at arrival."""
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
            and filters.is_zero_variance([g.members[i].arrived().reward for i in members])
        ):
            fate = filters.FILTERED_ZERO_VARIANCE
        if fate is not None:
            reward = g.members[members[0]].arrived().reward
            for i in members:
                self._finish(g, i, fate)
            self.outcomes.record(fate, self.clock(), float(reward))
            return
        if not members:
            self.outcomes.record(empty_fate or g.last_fate, self.clock())
            return
        for i in members:
            g.members[i].state = READY
        g.min_version = min(g.members[i].min_version for i in members)
        self._ready.append(g)
        self.outcomes.record(READY_OUTCOME, self.clock())

    def _hand_out(self, g: GroupState, now: float) -> tuple[Group, list[float]]:
        """A ready group leaves for the learner: its members end `trained`; returns it with each member's
        seconds since arrival (put-to-get latency)."""
        members = g.indices(READY)
        group = Group(g.group_id, [g.members[i].arrived() for i in members])
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
            held = [m.arrived() for m in members]
            trained = [t.loss_mask != 0 for t in held]
            stale = [(t.versions < oldest_allowed) & mask for t, mask in zip(held, trained, strict=True)]
            if any(mask.any() and not (mask & ~old).any() for mask, old in zip(trained, stale, strict=True)):
                continue
            for m, t, old in zip(members, held, stale, strict=True):
                if old.any():
                    m.trajectory = t.replace(loss_mask=np.where(old, 0, t.loss_mask).astype(t.loss_mask.dtype))
                    m.min_version = m.trajectory.min_version
                    self.ledger.count("stale_tokens_masked", int(np.count_nonzero(old)))
                    self.ledger.count("stale_samples_masked")
            g.min_version = min(m.min_version for m in members)

    def _drop_stale(self, learner_version: int) -> None:
        fresh: deque[GroupState] = deque()
        for g in self._ready:
            if self.staleness.trainable(g.min_version, learner_version):
                fresh.append(g)
                continue
            for i in g.indices(READY):
                self._finish(g, i, DROPPED_STALE)
            self.ledger.count("groups_dropped_stale")
            self._forget_if_done(g)
        self._ready = fresh

    def _drop_group_stale(self, g: GroupState, i: int, t: Trajectory) -> None:
        """Member i was aborted by its engine as certain to exceed the bound: the whole group is
        `dropped_stale` now (members not yet back take that fate when they arrive)."""
        self._finish(g, i, DROPPED_STALE, t)
        for j in g.indices(PENDING) + g.indices(ARRIVED):
            self._finish(g, j, DROPPED_STALE)
        g.resolved, g.late_fate = True, DROPPED_STALE
        self._unresolved -= 1
        self.ledger.count("groups_dropped_stale")

    def _forget_if_done(self, g: GroupState) -> None:
        if g.resolved and g.in_flight() == 0:
            self._groups.pop(g.group_id, None)
