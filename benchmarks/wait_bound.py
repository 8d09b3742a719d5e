"""The best throughput the `wait` stale policy allows: the replay queue's admission control and wait gate
(asyncrl/buffer/core.py; both ask the bound of asyncrl/staleness.py, as the replay does) replayed on an ideal
engine and an ideal learner (used by `limits.py`).

Why a replay: under `stale_policy: wait` a group admitted at version a must be trained at the latest at version
a + eta, so the learner stops until the group's longest sample is done. How long that takes depends on how fast
the engine decodes one sequence among the others running, not on its throughput, and the capacity limit of
`limits.py` does not see it. With W2's heavy tail (p99 512 tokens, eta 4), it is the binding limit.

The ideal machine (every figure measured by `limits.py` in the same run):
- engine: each running sequence gains one token per engine step; a step with n sequences running takes
  `StepCost` a + b n seconds (`Engine` decoding n sequences at once), x `engine_slowdown` while the learner
  trains (both at full load: E / E_together). Prefill and weight updates are free; an update is confirmed the
  moment the learner steps (admission version = learner version).
- learner: a step on k tokens takes k / learner_rate seconds alone, its progress slowed by `learner_slowdown`
  (L / L_together) while the engine decodes.
- queue: group n is admitted as soon as n + 1 <= (v + eta + 1) B and the in-flight cap allows, and, with
  `ready_lead` (`buffer.max_ready_batches`), while fewer than `ready_lead` B groups are ready or the learner's
  next step waits for an old group; a step at learner version v starts once no group admitted at a version
  <= v - eta is unfinished and B groups are ready, and trains the B oldest ready groups.
A group's G samples share one length (W2: the prompt's `max_tokens`, EOS ignored): G sequences that finish
together.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.staleness import Staleness


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine decode step with n sequences running: `fixed_s + per_sequence_s * n`."""

    fixed_s: float
    per_sequence_s: float

    def __call__(self, sequences: int) -> float:
        return self.fixed_s + self.per_sequence_s * sequences


def fit_step_cost(points: list[tuple[int, float]]) -> StepCost:
    """Least-squares line through (sequences running, seconds per step) points; at least two distinct n."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError(f"fit_step_cost needs two different sequence counts (got {points})")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return StepCost(mean_y - slope * mean_x, slope)


@dataclass(frozen=True)
class Stream:
    """The prompt stream in consumption order: each group's generation length and trained tokens."""

    lengths: list[int]
    tokens: list[int]
    group_size: int


def replay_wait(
    stream: Stream,
    *,
    steps: int,
    batch_groups: int,
    eta: int,
    step_cost: StepCost,
    learner_rate: float,
    engine_slowdown: float = 1.0,
    learner_slowdown: float = 1.0,
    max_in_flight: int = 256,
    ready_lead: int | None = None,
) -> dict:
    """Replay `steps` learner steps; -> seconds from the start of generation to the last step's end, trained
    tokens, tokens/s and the learner's total wait. eta = 0 replays `sync` (the engine idles while the
    learner trains: nothing else is admitted)."""
    B, G = batch_groups, stream.group_size
    bound = Staleness(eta)
    t, version, trained_tokens, wait_s = 0.0, 0, 0, 0.0
    admitted_at: list[int] = []  # admission version of each admitted group
    left: dict[int, int] = {}  # running group -> tokens still to generate
    done_at: dict[int, float] = {}  # finished group -> when
    ready: set[int] = set()  # finished, not yet trained
    idle_since, busy = 0.0, None  # busy: [seconds of the step in progress still to go at full speed, tokens]

    def gated(v: int) -> bool:  # a step at version v waits for an unfinished group admitted at <= v - eta
        return any(bound.last_chance(admitted_at[g], v) for g in left)

    def lead_holds() -> bool:
        return ready_lead is not None and len(ready) >= ready_lead * B and not gated(version + (busy is not None))

    while version < steps:
        while (n := len(admitted_at)) < len(stream.lengths) and n + 1 <= bound.admission_limit(version, B) and (len(left) + 1) * G <= max_in_flight and not lead_holds():
            admitted_at.append(version)
            left[n] = stream.lengths[n]
        if busy is None and not gated(version) and len(ready) >= B:
            batch = sorted(ready)[:B]
            ready.difference_update(batch)
            gate = [done_at[g] for g, a in enumerate(admitted_at) if bound.last_chance(a, version)]
            start = max([idle_since, *gate, *(done_at[g] for g in batch)])
            tokens = sum(stream.tokens[g] for g in batch)
            wait_s += start - idle_since
            busy = [tokens / learner_rate - (t - start) / learner_slowdown, tokens]
        if left:
            dt = step_cost(len(left) * G) * (engine_slowdown if busy is not None else 1.0)
            t += dt
            if busy is not None:
                busy[0] -= dt / learner_slowdown
            for g in list(left):
                left[g] -= 1
                if left[g] <= 0:
                    del left[g]
                    done_at[g] = t
                    ready.add(g)
        elif busy is not None:
            t += max(0.0, busy[0])
            busy[0] = 0.0
        else:
            raise ValueError(f"the replay stalled at version {version}: nothing running and no step possible ({len(stream.lengths)} groups for {steps} steps of {B})")
        if busy is not None and busy[0] <= 0:  # done: at t, less what it had to spare of the last engine step
            idle_since = t + busy[0] * learner_slowdown
            version, trained_tokens, busy = version + 1, trained_tokens + busy[1], None
    return {"seconds": idle_since, "tokens": trained_tokens, "tokens_per_s": trained_tokens / idle_since, "learner_wait_s": wait_s}
