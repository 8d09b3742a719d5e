"""The replay queue's section (`buffer`): the staleness bound and what happens to samples that would outlive it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.base import Section
from asyncrl.staleness import Staleness


class BufferConfig(Section):
    max_staleness: int = Field(4, ge=0, le=1024)
    """eta: the largest policy lag (learner version minus a sample's min_version) allowed in a gradient."""
    stale_policy: Literal["drop", "wait", "continue"] = "wait"
    """What happens to a sample that would outlive `max_staleness`. `wait` (default): nothing is aborted or dropped
    for staleness; the learner's next step waits until every group for which that step is the last one within the
    bound (started at admission version <= learner version - max_staleness) is ready, and trains the oldest groups
    first, so long samples are trained and the trained length distribution is the generated one. `drop`: such
    samples are aborted in flight (`abort_stale_in_flight`) or dropped at hand-out, so the learner never waits for
    them but trains a distribution biased to short samples. `continue` (partial rollouts): the sample keeps
    generating under each new policy version (its tokens carry the version and behaviour log-prob they were
    sampled with) and the learner never waits; at hand-out its tokens older than the bound are masked out of the
    loss (kept as context), so long samples are trained on their newer tokens. A group with a member that has no
    token left within the bound is dropped. Whichever policy, no trained token has lag > `max_staleness`."""
    abort_stale_in_flight: bool = True
    """Under `stale_policy: drop`, abort a running request as soon as it is certain to exceed `max_staleness` (its
    first token is more than `max_staleness` versions older than the weights its engine now serves): it ends
    `dropped_stale` with its group, and the engine's slot goes to new work instead of tokens that would be thrown
    away. Ignored under `wait` and `continue`, which abort nothing."""
    group_timeout_s: float = Field(120.0, gt=0)
    """A group whose members are not all in within this time after its first member is a straggler."""
    straggler_policy: Literal["drop", "partial"] = "drop"
    """`drop` the whole group, or train the finished members (`partial`, needs >= 2 members for group advantages)."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (their group advantage is 0). On by default; the `dapo`,
    `cispo` and `scalerl` presets ask for it too (`asyncrl.algo.registry.PRESET_FILTERS`): an explicit value wins."""
    filter_overlong: bool = False
    """Drop trajectories truncated at `rollout.max_tokens`."""
    pass_rate_curriculum: bool = False
    """Retire prompts whose pass rate reached `pass_rate_threshold` (ScaleRL no-positive-resampling). The
    `scalerl` preset turns it on unless it is set explicitly (`asyncrl.algo.registry.PRESET_FILTERS`)."""
    pass_rate_threshold: float = Field(0.9, gt=0, le=1)
    """Pass rate at which a prompt is retired (0.9 is ScaleRL's)."""
    capacity_groups: int = Field(1024, ge=1)
    """Ready groups held before producers are back-pressured."""
    max_ready_batches: int | None = Field(1, ge=1)
    """Stop starting groups while this many learner batches (B groups each) are ready and the learner's next
    step may take them (starts go on while that step waits for an unfinished old group, `stale_policy: wait`).
    η bounds how old a sample may be; this bounds how far generation runs ahead of a learner that cannot keep
    up, where finished samples would otherwise wait in the queue. 1 (default): on W1 streaming trained samples
    1.45 versions old instead of 3.1 at the same step time, and higher accuracy; on W2 streaming 1.09x the
    tokens/s and 2.6 instead of 3.2 (four rounds; on two shared cores an engine running ahead slows the
    learner). None: `max_staleness` and `capacity_groups` alone limit the lead, for engines with room to spare
    and long generations, where starting groups early hides their latency. docs/architecture.md#admission-control."""
    log_parquet: bool = True
    """Append every trajectory with its fate to `<run>/trajectories.parquet`."""

    @property
    def staleness(self) -> Staleness:
        """The bound `max_staleness` as the object every part of the system asks (`asyncrl.staleness`)."""
        return Staleness(self.max_staleness)

    @property
    def abort_after_lag(self) -> int | None:
        """The bound engines abort running requests at (`Engine.abort_stale`: those certain to exceed
        `max_staleness`), under `stale_policy: drop` with `abort_stale_in_flight`; None = never."""
        return self.max_staleness if self.abort_stale_in_flight and self.stale_policy == "drop" else None
