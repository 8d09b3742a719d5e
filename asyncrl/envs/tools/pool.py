"""The tool-worker pool: Ray actors that run tools and user rewards in sandboxes, apart from the engines, so a
slow, crashing or hostile tool never blocks or kills a rollout worker.

- `ToolWorker` (one Ray actor per slot, named `<prefix>-<i>`): runs `calculator` in its own process (it is
  bounded) and `python` and user rewards each in a fresh sandboxed process; counts calls and errors by tool.
- `ToolPool` (driver): starts `tools.num_workers` workers, heartbeats them from `poll()` (the fleet's
  `upkeep`), and replaces a dead or hung one under the same name, `tools.max_restarts_per_worker` times at most
  (then the worker is quarantined: its calls go to the others).
- `ToolClient` (picklable; travels in `WorkerSpec.tools`): the `ToolExecutor` the rollout workers use. It finds
  workers by name, so a replacement is found without telling anyone; a call whose worker dies raises
  `ToolInfraError("tool_worker_died")` as soon as Ray reports the death, not at the call's timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from asyncrl.cluster.calls import named_get
from asyncrl.cluster.restarts import RestartBudget
from asyncrl.config import Config, ToolsConfig
from asyncrl.envs.tools.base import (
    InProcessTools,
    RewardError,
    ToolCall,
    ToolInfraError,
    ToolResult,
    check_reward_value,
)
from asyncrl.envs.tools.isolation import Capabilities, lease_uid_block
from asyncrl.envs.tools.mounts import RewardCode, reward_code
from asyncrl.envs.tools.processes import ItemOutcome, RewardItem
from asyncrl.envs.tools.python import run_python
from asyncrl.envs.tools.sandbox import Sandbox, SandboxLimits

HANDLE_TTL_S = 1.0
"""A client looks a worker's name up again after this long, so it reaches a replacement within a second."""
_START_TIMEOUT_S = 60.0


def needs_tool_pool(cfg: Config) -> bool:
    """Whether the run starts the pool: `tools.pool`, or with `auto` a user `module:function` reward or a
    multi-turn environment (user code and tool calls never run in the rollout worker's process)."""
    from asyncrl.envs.base import is_multi_turn

    if cfg.tools.pool != "auto":
        return cfg.tools.pool == "on"
    return ":" in cfg.env.reward or is_multi_turn(cfg.env.name)


@dataclass
class ToolTally:
    """Calls and errors by tool (`calculator`, `python`, `reward`) and reason (`timeout`, `memory`, `error`, ...)."""

    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, tool: str, error: str | None) -> None:
        self.calls[tool] = self.calls.get(tool, 0) + 1
        if error is not None:
            reasons = self.errors.setdefault(tool, {})
            reasons[error] = reasons.get(error, 0) + 1

    def merged(self, other: ToolTally) -> ToolTally:
        total = ToolTally(dict(self.calls), {tool: dict(r) for tool, r in self.errors.items()})
        for tool, n in other.calls.items():
            total.calls[tool] = total.calls.get(tool, 0) + n
        for tool, reasons in other.errors.items():
            for reason, n in reasons.items():
                total.errors.setdefault(tool, {})[reason] = total.errors.get(tool, {}).get(reason, 0) + n
        return total


@dataclass(frozen=True)
class RewardOutcome:
    """A sandboxed reward's value, or why there is none (the trajectory fails `reward_error: <error>`)."""

    value: float | None
    error: str | None = None


class ToolWorker:
    """One tool-worker actor (plain class: the pool runs it as `ray.remote(ToolWorker)`).

    User rewards run in sandboxed processes kept per reward (the module imported once, `reward_process_calls`
    calls each). Reward calls that wait for a free call slot run together: the slot takes every waiting call of
    the same reward, up to `reward_batch`, to its process in one message, each call under its own limits. Under
    light load a call finds a slot free and goes alone."""

    def __init__(
        self,
        name: str,
        limits: SandboxLimits,
        uid_base: int,
        calls: int = 4,
        reward_batch: int = 32,
        reward_process_calls: int = 1024,
        code: dict[str, RewardCode] | None = None,
        reward_mounts: Sequence[str] = (),
    ) -> None:
        self.name = name
        uid, self._uid_lock = lease_uid_block(uid_base)  # held until this process exits
        self.sandbox = Sandbox(
            limits, uid, reward_process_calls, code=dict(code or {}), reward_mounts=tuple(reward_mounts)
        )
        self.tally = ToolTally()
        self.reward_batch = min(reward_batch, reward_process_calls)
        self.reward_runs = 0
        """Batches the reward calls went in (fewer than the calls when batched)."""
        self._slots = asyncio.Semaphore(calls)
        self._waiting: dict[str, list[tuple[RewardItem, asyncio.Future]]] = {}

    async def ready(self) -> Capabilities:
        self.sandbox.warm()
        return self.sandbox.capabilities

    async def ping(self) -> ToolTally:
        """The heartbeat; answers with the counts so far (kept by the pool should this worker die)."""
        return self.tally

    async def pid(self) -> int:
        return os.getpid()

    async def sandbox_uid(self) -> int:
        """The first uid of the block this worker leased (`lease_uid_block`)."""
        return self.sandbox.uid

    async def start_seconds(self) -> list[float]:
        return list(self.sandbox.start_seconds)

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        async with self._slots:
            if call.name == "python":
                result = await run_python(self.sandbox, call.arguments, timeout_s)
            else:  # the calculator (bounded, no user code) runs here; anything else is `unknown_tool`
                result = await InProcessTools().call(call, timeout_s)
        self.tally.count(call.name, result.error)
        return result

    async def reward(
        self,
        reward: str,
        response: str,
        ground_truth: str,
        finish_reason: str,
        extra_info: dict[str, Any],
        timeout_s: float,
    ) -> RewardOutcome:
        mine = (
            RewardItem(response, ground_truth, finish_reason, extra_info, timeout_s),
            asyncio.get_running_loop().create_future(),
        )
        waiting = self._waiting.setdefault(reward, [])
        waiting.append(mine)
        async with self._slots:
            if mine in waiting:  # else an earlier slot took this call along with its own
                waiting.remove(mine)
                batch = [mine, *waiting[: self.reward_batch - 1]]
                del waiting[: self.reward_batch - 1]
                # Shielded: a cancelled caller must not cancel the calls it took along.
                await asyncio.shield(asyncio.ensure_future(self._score(reward, batch)))
        return await mine[1]

    async def _score(self, reward: str, batch: list[tuple[RewardItem, asyncio.Future]]) -> None:
        self.reward_runs += 1
        try:
            outcomes = await self.sandbox.run_rewards(reward, [item for item, _ in batch])
        except Exception as e:  # the sandbox did not start (ToolInfraError): every call of the batch says why
            for _, answer in batch:
                answer.set_exception(e)
            return
        for (_, answer), outcome in zip(batch, outcomes, strict=True):  # one outcome per item
            result = _reward_outcome(outcome)
            self.tally.count("reward", None if result.error is None else (outcome.reason or "bad_value"))
            answer.set_result(result)

    async def shutdown(self) -> None:
        await self.sandbox.close()


def _reward_outcome(outcome: ItemOutcome) -> RewardOutcome:
    if outcome.reason is not None:
        return RewardOutcome(None, f"{outcome.reason} after {outcome.seconds:.1f}s {outcome.detail}".strip())
    try:
        return RewardOutcome(check_reward_value(outcome.value))
    except RewardError as e:
        return RewardOutcome(None, str(e))


@dataclass
class ToolClient:
    """The rollout workers' `ToolExecutor`: each call goes to the next worker by name (round robin)."""

    names: tuple[str, ...]
    namespace: str | None = None
    _handles: dict[str, tuple[Any, float]] = field(default_factory=dict, repr=False)
    _turn: Any = field(default=None, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"names": self.names, "namespace": self.namespace}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ToolClient.__init__(self, **state)

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        return await self._on_worker("call", (call, timeout_s))

    async def reward(
        self,
        reward: str,
        response: str,
        ground_truth: str,
        *,
        finish_reason: str,
        extra_info: dict[str, Any],
        timeout_s: float,
    ) -> float:
        """A user `module:function` reward in a sandboxed run on a tool worker; a built-in one (trusted, pure) here."""
        if ":" not in reward:
            return await InProcessTools().reward(
                reward, response, ground_truth, finish_reason=finish_reason, extra_info=extra_info, timeout_s=timeout_s
            )
        outcome = await self._on_worker(
            "reward", (reward, response, ground_truth, finish_reason, dict(extra_info), timeout_s)
        )
        if outcome.error is not None:
            raise RewardError(outcome.error)
        return outcome.value

    async def _on_worker(self, method: str, args: tuple) -> Any:
        name, handle = self._pick()
        try:  # no timeout of its own: the worker kills the sandbox at `timeout_s`, the pool kills a hung worker
            return await getattr(handle, method).remote(*args)
        except RayActorError:
            self._handles.pop(name, None)
            raise ToolInfraError("tool_worker_died", name) from None
        except RayTaskError as e:
            if isinstance(e.cause, ToolInfraError):
                raise ToolInfraError(e.cause.reason, f"{name}: {e.cause.detail}") from None
            raise

    def _pick(self) -> tuple[str, Any]:
        """The next worker whose name resolves (one being replaced is skipped)."""
        if self._turn is None:
            self._turn = itertools.count(random.randrange(len(self.names)))
        start = next(self._turn)
        for i in range(len(self.names)):
            name = self.names[(start + i) % len(self.names)]
            handle, at = self._handles.get(name, (None, 0.0))
            if handle is None or time.monotonic() - at > HANDLE_TTL_S:
                try:
                    handle = ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    continue
                self._handles[name] = (handle, time.monotonic())
            return name, handle
        raise ToolInfraError("no_tool_worker", f"none of {', '.join(self.names)} is alive")


@dataclass(frozen=True)
class ToolPoolEvent:
    """A tool worker replaced by `poll` (`died`: its actor is gone; `hung`: no heartbeat answer in time), or not
    replaced (`quarantined`: its restart budget is spent; `detail` says so)."""

    worker: str
    kind: str
    detail: str = ""

    def __str__(self) -> str:
        if self.kind == "quarantined":
            return f"tool worker {self.worker} quarantined, not replaced: {self.detail}"
        return f"tool worker {self.worker} {self.kind}{': ' + self.detail if self.detail else ''}; replaced"


@dataclass
class _Slot:
    handle: Any
    ping: Any = None
    ping_sent: float = 0.0
    tally: ToolTally = field(default_factory=ToolTally)
    answered: bool = False
    """Whether it ever answered a heartbeat: until then it may still be starting (a Ray worker process start can
    take seconds on a busy machine), and gets `_START_TIMEOUT_S` rather than `tools.heartbeat_timeout_s`."""


class ToolPool:
    """Driver-side owner of the tool workers. Not thread-safe; call from the controller's thread."""

    def __init__(
        self,
        tools: ToolsConfig,
        prefix: str | None = None,
        placement_timeout_s: float = 300.0,
        rewards: Sequence[str] = (),
    ) -> None:
        """`rewards`: the user rewards (`module:function`) the run calls, whose code folders are resolved here
        (`mounts.reward_code`) and shipped to the workers."""
        self.config = tools
        self.code = {r: reward_code(r) for r in rewards if ":" in r}
        self.placement_timeout_s = placement_timeout_s
        self._pg: Any = None
        self.limits = SandboxLimits.from_config(tools)
        prefix = prefix or f"asyncrl-tool-{uuid.uuid4().hex[:6]}"
        self.names = tuple(f"{prefix}-{i}" for i in range(tools.num_workers))
        self._slots: dict[str, _Slot] = {}
        self._retired = ToolTally()
        """Counts of workers that died (their last heartbeat's)."""
        self.replaced = 0
        self.restarts = RestartBudget(tools.max_restarts_per_worker, tools.max_restarts_per_worker + 1, 1e9)
        """Which dead or hung workers are replaced (`tools.max_restarts_per_worker`)."""
        self.capabilities: Capabilities | None = None
        self._actor_cls = ray.remote(ToolWorker)

    def start(self) -> None:
        """Start every worker and wait until each answers (`launch`, then `wait_ready`)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start every worker without waiting for it: a run starts its engines meanwhile. The workers get a
        placement group of their own (SPREAD), apart from the engines and the learner."""
        from asyncrl.cluster import placement

        cpus = self.config.num_cpus_per_worker
        self._pg = placement.reserve(
            "tools", [placement.bundle(cpus, 0)] * len(self.names), "SPREAD", self.placement_timeout_s
        )
        for name in self.names:
            self._slots[name] = _Slot(self._spawn(name))

    def wait_ready(self) -> None:
        """Wait until every launched worker answers; the sandbox capabilities come from the first."""
        answers = named_get(
            [slot.handle.ready.remote() for slot in self._slots.values()],
            _START_TIMEOUT_S,
            f"tool workers {', '.join(self._slots)}: ready",
        )
        self.capabilities = answers[0]
        for slot in self._slots.values():
            slot.answered = True

    def client(self) -> ToolClient:
        return ToolClient(self.names, ray.get_runtime_context().namespace)

    def poll(self) -> list[ToolPoolEvent]:
        """One heartbeat round without waiting: collect answered pings, send new ones, replace the workers whose
        actor died or whose ping went unanswered for `tools.heartbeat_timeout_s`."""
        events = []
        for name, slot in list(self._slots.items()):
            if slot.ping is None:
                slot.ping, slot.ping_sent = slot.handle.ping.remote(), time.monotonic()
                continue
            event = self._heard(name, slot)
            if event is not None:
                events.append(event)
                quarantined = self.restarts.failed(name)
                if quarantined is None:
                    self._replace(name)
                else:
                    self._retire(name)
                    events.append(ToolPoolEvent(name, "quarantined", quarantined))
        return events

    @property
    def healthy(self) -> int:
        """Workers not quarantined (serving, or replaced and starting)."""
        return len(self._slots)

    def tally(self) -> ToolTally:
        total = self._retired
        for slot in self._slots.values():
            total = total.merged(slot.tally)
        return total

    def summary(self) -> dict[str, Any]:
        """The run summary's `tools` entry: counts by tool and reason, replacements, the isolation in force."""
        self._refresh_tallies()
        tally = self.tally()
        caps = asdict(self.capabilities) if self.capabilities else None
        return {
            "calls": tally.calls,
            "errors": tally.errors,
            "workers_replaced": self.replaced,
            "quarantined": dict(self.restarts.quarantined),
            "sandbox": caps,
        }

    def shutdown(self) -> None:
        slots = list(self._slots.values())
        ray.wait([s.handle.shutdown.remote() for s in slots], num_returns=len(slots), timeout=10)
        for slot in slots:
            ray.kill(slot.handle)
        self._slots.clear()
        if self._pg is not None:
            from asyncrl.cluster import placement

            placement.release(self._pg)
            self._pg = None

    def _heard(self, name: str, slot: _Slot) -> ToolPoolEvent | None:
        """Read the outstanding ping: None if the worker is fine (or still has time), else why it goes."""
        try:
            slot.tally = ray.get(slot.ping, timeout=0)
        except GetTimeoutError:
            limit = self.config.heartbeat_timeout_s if slot.answered else _START_TIMEOUT_S
            if time.monotonic() - slot.ping_sent < limit:
                return None
            return ToolPoolEvent(name, "hung", f"no heartbeat answer in {limit:.0f}s")
        except RayActorError as e:
            return ToolPoolEvent(name, "died", str(e).splitlines()[0][:200])
        slot.ping, slot.answered = None, True
        return None

    def _retire(self, name: str) -> None:
        """Kill the worker of `name` and keep its counts."""
        old = self._slots.pop(name)
        self._retired = self._retired.merged(old.tally)
        ray.kill(old.handle, no_restart=True)

    def _replace(self, name: str) -> None:
        self._retire(name)
        deadline = time.monotonic() + 10.0
        while True:  # the dead actor's name is released once Ray has recorded its death (milliseconds)
            try:
                self._slots[name] = _Slot(self._spawn(name))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.replaced += 1

    def _refresh_tallies(self) -> None:
        for slot in self._slots.values():
            try:
                slot.tally = ray.get(slot.handle.ping.remote(), timeout=self.config.heartbeat_timeout_s)
            except (GetTimeoutError, RayActorError):
                pass  # keep its last heartbeat's counts

    def _spawn(self, name: str) -> Any:
        return self._actor_cls.options(**self._actor_options(name)).remote(
            name,
            self.limits,
            self.config.sandbox_uid_base,
            self.config.calls_per_worker,
            self.config.reward_batch,
            self.config.reward_process_calls,
            self.code,
            tuple(self.config.reward_mounts),
        )

    def _actor_options(self, name: str) -> dict[str, Any]:
        """Where a tool worker runs: its bundle of the pool's placement group (a replacement takes its
        predecessor's bundle)."""
        from asyncrl.cluster import placement

        # Calls beyond `calls_per_worker` wait on the worker's semaphore (time not counted against their timeout),
        # never in front of a heartbeat: the actor itself takes as many as Ray's async default.
        options = {
            "name": name,
            "num_cpus": self.config.num_cpus_per_worker,
            "max_concurrency": 1000,
            "max_restarts": 0,
        }
        if self._pg is not None:
            options["scheduling_strategy"] = placement.in_bundle(self._pg, self.names.index(name))
        return options
