"""Typed records passed between actors.

Each docstring states the record's invariant. Arrays are numpy so Ray moves them without pickling
element by element; nothing here imports torch, Ray or vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np

FinishReason = Literal["stop", "length", "abort", "error", "max_turns", "context", "timeout", "tool_error"]
"""Why a trajectory ended: the engine's reasons for one generation (`stop` = end-of-sequence, `length` = max_tokens),
and an episode's (`max_turns`, `context` = total tokens, `timeout` = wall time, `tool_error`)."""

# Terminal states of a dispatched sample (invariant 3). `filtered:<reason>` and `failed:<reason>` carry a reason.
TRAINED = "trained"
DROPPED_STALE = "dropped_stale"
STALE_FAILURE = "stale"
"""`failure` reason (text before the first ':') of a request its engine aborted because it was certain to exceed
`max_staleness`; the replay queue ends it, and its group, `dropped_stale` rather than `failed:`."""


@dataclass
class Prompt:
    """One task instance. `prompt_ids` are the tokens fed to the engine (chat template already applied)."""

    prompt_id: str
    prompt_ids: list[int]
    ground_truth: str
    text: str = ""
    data_source: str = "add"
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One rollout of one prompt.

    Invariant: `rollout_logprobs`, `loss_mask` and `versions` all have the length of `response_ids`.
    `rollout_logprobs[t]` is log mu(token t) under the distribution the engine sampled from
    (temperature/top-p applied). `loss_mask[t]` is 1 for policy-generated tokens and 0 for tokens the
    environment appended (tool observations). `versions[t]` is the policy version that produced token t;
    a trajectory that lived through an in-flight weight update spans several versions.
    """

    prompt_id: str
    group_id: str
    sample_index: int
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [T]
    rollout_logprobs: np.ndarray  # float32 [T]
    loss_mask: np.ndarray  # int8 [T]
    versions: np.ndarray  # int32 [T]
    finish_reason: FinishReason
    ground_truth: str = ""
    reward: float = 0.0
    failure: str | None = None
    """Why the trajectory failed (`timeout`, `reward_error: ...`, `engine_died: worker-1`), None if it did not."""
    worker: str = ""
    attempt: int | None = None
    """The attempt number of the request this answers (`Request.attempt`); None = unknown, and then the
    queue matches by `worker` only."""
    dispatch_version: int = 0
    """Policy version of the engine when the request started (lower bound of `versions`)."""
    submitted_at: float = 0.0
    finished_at: float = 0.0
    response_text: str = ""
    turn_starts: list[int] = field(default_factory=lambda: [0])
    """Offsets in `response_ids` where each model turn starts; the tokens between one turn's end and the next
    turn's start are an environment observation (`loss_mask` 0). A single-turn trajectory has `[0]`."""
    truncated: bool = False
    """The episode was cut by a limit (max turns, context, wall time, max_tokens) rather than ended by the
    model or the environment: GAE bootstraps from the value of its last state instead of treating it as terminal."""
    tool_calls: int = 0
    """Tool calls the model made during the episode (0 for environments without tools)."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay (`learner.routing_replay`): uint8 [N, moe_layers, top_k] (int16 beyond 256 experts), the
    experts the engine routed token n of `prompt_ids + response_ids` to in each MoE layer, for the first N tokens
    (N <= num_tokens: the engine never forwards the last sampled token); None = not recorded (dense models, or an
    engine that does not return routes). It travels with the trajectory's plain fields
    (`TrajectoryColumns.scalar_rows`), not as a column."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.rollout_logprobs) == len(self.loss_mask) == len(self.versions) == n):
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: per-token arrays differ in length "
                f"(ids {n}, logprobs {len(self.rollout_logprobs)}, mask {len(self.loss_mask)}, "
                f"versions {len(self.versions)})"
            )
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or len(routes) > len(self.prompt_ids) + n):
            raise ValueError(
                f"trajectory {self.group_id}/{self.sample_index}: routed_experts of shape {routes.shape} for"
                f" {len(self.prompt_ids) + n} tokens ([tokens, moe_layers, top_k] expected, at most one row a token)"
            )

    @functools.cached_property
    def min_version(self) -> int:
        """The oldest version among the tokens the loss trains (`loss_mask` 1): what a sample's staleness lag is
        measured from. Versions never decrease along a trajectory and its first token is sampled, so this is the
        first token's version unless `stale_policy: continue` masked the oldest tokens out. A trajectory without a
        trained token falls back to every token, and one without tokens to `dispatch_version`. Cached, as the
        arrays are never modified once the trajectory is built: the queue reads it on arrival and again for the
        batch's lags (`TrajectoryColumns.min_versions` computes the same for many at once)."""
        if not len(self.versions):
            return self.dispatch_version
        trained = self.versions[self.loss_mask != 0]
        return int(np.minimum.reduce(trained if len(trained) else self.versions))

    @property
    def max_version(self) -> int:
        return int(self.versions.max()) if len(self.versions) else self.dispatch_version

    @property
    def version_span(self) -> int:
        """max - min policy version of the model tokens (`loss_mask` 1; all tokens when none is): how many
        weight updates a long or multi-turn episode lived through. 0 for a trajectory of one version."""
        if not len(self.versions):
            return 0
        model = self.versions[self.loss_mask != 0]
        model = model if len(model) else self.versions
        return int(model.max()) - int(model.min())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    @property
    def turn_versions(self) -> list[int]:
        """The policy version of each model turn's first token (a turn may span several: see `versions`)."""
        return [int(self.versions[s]) if s < len(self.versions) else self.dispatch_version for s in self.turn_starts]

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def replace(self, **changes: Any) -> Trajectory:
        return dataclasses.replace(self, **changes)


@dataclass
class Group:
    """The readiness unit handed to the learner: all trajectories of one prompt (one in `sao`).

    Invariant: every member shares `group_id` and `prompt_id`; `min_version` is the oldest token's version.
    """

    group_id: str
    trajectories: list[Trajectory]

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


@dataclass
class Batch:
    """What the replay queue hands the learner for one step: groups, the learner version they were handed
    out at, and each sample's lag.

    Invariant: `lags[k] == version - min_version` of the k-th trajectory (groups in order, members in order),
    computed once, here, when the queue hands the batch out; the queue never hands out a lag above
    `max_staleness`. Every staleness figure downstream (metrics rows, histograms) is read from `lags`.
    """

    groups: list[Group]
    version: int
    lags: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lags = [self.version - t.min_version for g in self.groups for t in g.trajectories]

    def __reduce__(self) -> tuple[Any, ...]:
        """Crosses to the learner as `TrajectoryColumns` (one buffer per array field for the whole batch); the
        lags are computed again on arrival, from the same versions. A received batch whose groups were never
        read goes on as the columns it came in."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            members = [t for g in self.groups for t in g.trajectories]
            packed = ([(g.group_id, len(g.trajectories)) for g in self.groups], TrajectoryColumns.pack(members))
        return (_unpack_batch, (*packed, self.version))

    def __getattr__(self, name: str) -> Any:
        """`groups` of a received batch, built on first access (see `_unpack_batch`); called only for attributes
        the instance lacks."""
        packed = self.__dict__.pop("_packed", None) if name == "groups" else None
        if packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        sizes, columns = packed
        members, groups, start = columns.unpack(), [], 0
        for group_id, n in sizes:
            groups.append(Group(group_id, members[start : start + n]))
            start += n
        self.groups = groups
        return groups

    @property
    def num_samples(self) -> int:
        return len(self.lags)

    @property
    def staleness_mean(self) -> float:
        """Mean lag in policy versions (0.0 for an empty batch)."""
        return sum(self.lags) / max(1, len(self.lags))

    @property
    def staleness_max(self) -> int:
        return max(self.lags, default=0)


@dataclass
class StepStats:
    """What the learner reports for one optimizer step; every field is a plain number."""

    step: int
    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Request:
    """One generation for a rollout worker: sample `sample_index` of the group of `prompt`.

    `request_id` is unique per attempt (`<group_id>/<sample_index>/<attempt>`): a request re-dispatched
    after its worker died gets a new attempt number, so a late answer of the old attempt is recognisable.
    """

    request_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt: Prompt
    attempt: int = 0
    context_min_version: int | None = None
    """For a later call of a multi-turn episode: the oldest policy version among the episode's model tokens so
    far. The engine's stale abort judges the request by it (`Engine.abort_stale`), as the episode's trajectory
    will carry those tokens; None for a request that starts its trajectory."""


@dataclass(frozen=True)
class WeightLoad:
    """A rollout worker's answer to a weight sync (`RolloutWorker.update_weights`)."""

    version: int
    """The version its engine serves now."""
    served_at: float
    """`time.time()` on the worker's node when the engine began serving `version`: where a sync ends
    (`SyncResult.seconds`), whenever the controller gets round to collecting the answer."""


@dataclass
class Exchange:
    """What the replay queue answers a rollout worker's `put_and_acquire`: how many of the handed-in trajectories
    it accepted (as `put` counts them) and the next requests (as `acquire` hands them out), in one actor call."""

    accepted: int
    requests: list[Request]

    def __reduce__(self) -> tuple[Any, ...]:
        """Crosses as one tuple of plain values per request: Ray's pickler would otherwise call its Python-level
        hook and a dataclass reduction for every `Request` (twice the CPU, on both sides)."""
        return (_received_exchange, (self.accepted, [_request_row(r) for r in self.requests]))


_request_row = operator.attrgetter(*(f.name for f in dataclasses.fields(Request)))


def _received_exchange(accepted: int, rows: list[tuple[Any, ...]]) -> Exchange:
    """Inverse of `Exchange.__reduce__`."""
    return Exchange(accepted, [Request(*row) for row in rows])


_PER_TOKEN_FIELDS = ("response_ids", "rollout_logprobs", "loss_mask", "versions")
"""`Trajectory` fields with one entry per response token (they share each trajectory's length)."""
_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory))
_ARRAYS_AT = _FIELDS.index("prompt_ids")
"""Where the array fields (`prompt_ids`, then the per-token ones) start in `Trajectory`'s field order:
`TrajectoryColumns.unpack` passes fields by position (a quarter of the cost of keywords)."""
_SCALAR_FIELDS = _FIELDS[:_ARRAYS_AT] + _FIELDS[_ARRAYS_AT + 1 + len(_PER_TOKEN_FIELDS) :]
"""The other `Trajectory` fields, in the order of `TrajectoryColumns.scalar_rows`."""
_scalar_row = operator.attrgetter(*_SCALAR_FIELDS)
_DISPATCH_VERSION_AT = _SCALAR_FIELDS.index("dispatch_version")


@dataclass(frozen=True)
class TrajectoryColumns:
    """N trajectories column-wise, the wire form of `PackedTrajectories`: one array per array field for all N
    (Ray passes each numpy array as one zero-copy buffer, where a list of `Trajectory` costs five buffers and a
    pickled record per item) and one tuple of plain values per trajectory.

    Invariant: trajectory k owns `prompt_lengths[k]` entries of `prompt_ids` and `response_lengths[k]` entries of
    each per-token column, starting at the sum of the earlier lengths; `scalar_rows[k]` holds its other fields
    in `_SCALAR_FIELDS` order. Each array column is the `np.concatenate` of the trajectories' arrays: dtypes are
    kept when the trajectories agree (the documented ones always do), mixed ones are promoted without loss.
    """

    prompt_ids: np.ndarray  # [sum of prompt_lengths]
    prompt_lengths: list[int]  # [N]
    response_ids: np.ndarray  # [sum of response_lengths]
    rollout_logprobs: np.ndarray  # [sum of response_lengths]
    loss_mask: np.ndarray  # [sum of response_lengths]
    versions: np.ndarray  # [sum of response_lengths]
    response_lengths: list[int]  # [N]
    scalar_rows: list[tuple[Any, ...]]  # [N]

    @classmethod
    def pack(cls, trajectories: Sequence[Trajectory]) -> TrajectoryColumns:
        def column(name: str) -> np.ndarray:
            return np.concatenate([getattr(t, name) for t in trajectories]) if trajectories else np.zeros(0, np.int32)

        return cls(
            prompt_ids=column("prompt_ids"),
            prompt_lengths=[len(t.prompt_ids) for t in trajectories],
            **{name: column(name) for name in _PER_TOKEN_FIELDS},
            response_lengths=[len(t.response_ids) for t in trajectories],
            scalar_rows=[_scalar_row(t) for t in trajectories],
        )

    def min_versions(self) -> np.ndarray:
        """Each trajectory's `Trajectory.min_version` (its oldest trained token's version; every token's when none
        is trained; `dispatch_version` without tokens) from reductions over the `versions` column."""
        lengths = np.asarray(self.response_lengths, dtype=np.int64)
        out = np.fromiter((row[_DISPATCH_VERSION_AT] for row in self.scalar_rows), dtype=np.int64, count=len(lengths))
        has_tokens = lengths > 0
        if has_tokens.any():
            # reduceat over the starts of the non-empty trajectories only:
            # each segment then runs to the next one's start
            starts = (np.cumsum(lengths) - lengths)[has_tokens]
            oldest = np.minimum.reduceat(self.versions, starts)
            if not self.loss_mask.all():  # masked tokens do not count, unless a trajectory has no other
                never = np.iinfo(self.versions.dtype).max
                trained = np.minimum.reduceat(np.where(self.loss_mask != 0, self.versions, never), starts)
                oldest = np.where(trained != never, trained, oldest)
            out[has_tokens] = oldest
        return out

    def unpack(self) -> list[Trajectory]:
        """The trajectories; their arrays are views of the columns."""
        prompts = _split(self.prompt_ids, self.prompt_lengths)
        columns = (_split(getattr(self, name), self.response_lengths) for name in _PER_TOKEN_FIELDS)
        per_token = zip(*columns, strict=True)
        at = _ARRAYS_AT
        out = [
            Trajectory(*(*row[:at], prompt, *arrays, *row[at:]))  # one tuple: mypy miscounts mixed star arguments
            for prompt, arrays, row in zip(prompts, per_token, self.scalar_rows, strict=True)
        ]
        # Fills each `min_version` cache from one reduction for all, where each would cost a numpy call of its own.
        for t, version in zip(out, self.min_versions().tolist(), strict=True):
            t.__dict__["min_version"] = version
        return out


class PackedTrajectories(Sequence[Trajectory]):
    """A list of trajectories that crosses between actors as `TrajectoryColumns` (see there for why): the
    sender packs when Ray pickles it, the receiver unpacks once, on first access. Pass one wherever a
    `Sequence[Trajectory]` goes to another actor in bulk (`ReplayQueue.put`)."""

    def __init__(self, trajectories: Sequence[Trajectory]) -> None:
        self._trajectories: list[Trajectory] | None = list(trajectories)
        self._columns: TrajectoryColumns | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # A module-level function: cloudpickle would send a classmethod's code along with every call.
        return (_received_trajectories, (self.columns(),))

    def columns(self) -> TrajectoryColumns:
        if self._columns is None:
            self._columns = TrajectoryColumns.pack(self.trajectories())
        return self._columns

    def trajectories(self) -> list[Trajectory]:
        if self._trajectories is None:
            assert self._columns is not None  # the list is only ever dropped for the columns it arrived as
            self._trajectories = self._columns.unpack()
        return self._trajectories

    def __len__(self) -> int:
        return len(self.trajectories())

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories())

    @overload
    def __getitem__(self, index: int) -> Trajectory: ...

    @overload
    def __getitem__(self, index: slice) -> list[Trajectory]: ...

    def __getitem__(self, index: int | slice) -> Trajectory | list[Trajectory]:
        return self.trajectories()[index]


def _received_trajectories(columns: TrajectoryColumns) -> PackedTrajectories:
    """Inverse of `PackedTrajectories.__reduce__`: unpacked on first access."""
    packed = PackedTrajectories([])
    packed._trajectories, packed._columns = None, columns
    return packed


def _split(values: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """`values` cut into consecutive views of `lengths` entries each."""
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def _unpack_batch(sizes: list[tuple[str, int]], columns: TrajectoryColumns, version: int) -> Batch:
    """Inverse of `Batch.__reduce__`: `sizes` are (group_id, members) of each group, in order. The lags come from
    the columns in one reduction; the groups are built when first read (`Batch.__getattr__`), so a receiver that
    reads only the lags and counts, or sends the batch on, builds no per-trajectory objects."""
    batch = Batch.__new__(Batch)
    batch.version = version
    batch.__dict__["_packed"] = (sizes, columns)  # read from `__dict__` only, by `__reduce__` and `__getattr__`
    batch.lags = (version - columns.min_versions()).tolist()
    return batch
