"""`RolloutPool`: the driver-side handle of N `RolloutWorker` actors (`rollout-0`, `rollout-1`, ...).

It starts workers and waits for their engines, broadcasts weights (put into the object store once),
scales the pool at runtime, and replaces dead workers. A started worker serves only once its engine has
loaded the latest published weights; `poll()` does that, and notices dead workers, without waiting, so the
learner never pauses for them. Invariant 7: a weight sync either completes on every engine — each confirms
the new version — or raises within its timeout naming the engines that did not (with `replace_dead`, an
engine that died is replaced instead of failing the sync).
Invariant 3: requests of a removed or dead worker are handed back to the queue (`requeue_worker`), so none
is lost; a late answer of the old attempt is recognisable by its request id.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from asyncrl.cluster import placement
from asyncrl.cluster.calls import named_get
from asyncrl.cluster.restarts import RestartBudget
from asyncrl.config import Config, EnvConfig, RolloutConfig
from asyncrl.envs.tools.base import ToolExecutor
from asyncrl.models.shipping import ShippedModel, ship
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.membership import (
    Heartbeat,
    Joining,
    NodeLocalRolloutWorker,
    PoolEvent,
    WorkerDiedError,
    WorkerStartError,
    died,
    start_failure,
    wait_in_turns,
    wait_or_say,
)
from asyncrl.rollout.spread import CONTROL_TIMEOUT_S, EvaluationTimeout, SpreadCall, WorkerCalls
from asyncrl.rollout.worker import WorkerSpec
from asyncrl.weights.published import PublishedWeights

__all__ = [
    "EvaluationTimeout",
    "PoolEvent",
    "RolloutPool",
    "SpreadCall",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WorkerDiedError",
    "WorkerStartError",
]


class WeightSyncError(RuntimeError):
    """A weight sync did not complete on every engine (the message names each failed engine)."""


class WeightSyncTimeout(WeightSyncError):
    """Some engine did not confirm the new version within the sync timeout."""


class RolloutPool(WorkerCalls):
    """Driver-side owner of the rollout workers. Not thread-safe; call from one controller thread.

    Every worker gets the same typed `WorkerSpec` (built here from the arguments, or from the run's config by
    `from_config`), with its own sampling seed. `latest`: the last published weights (the weight sync's
    `latest`), loaded by every worker started later.
    """

    def __init__(
        self,
        model_dir: str,
        rollout: RolloutConfig,
        env: EnvConfig | None = None,
        queue: Any = None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
        sampling: SamplingSpec | None = None,
        abort_after_lag: int | None = None,
        latest: Callable[[], PublishedWeights | None] = lambda: None,
        replace_dead: bool = False,
        placement_timeout_s: float = 300.0,
        model: ShippedModel | None = None,
        tools: ToolExecutor | None = None,
        lora_rank: int | None = None,
    ) -> None:
        self.spec = WorkerSpec(
            model_dir=str(model_dir),
            rollout=rollout,
            env=env or EnvConfig.model_validate({}),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            sampling=sampling,
            abort_after_lag=abort_after_lag,
            tools=tools,
            lora_rank=lora_rank,
        )
        self.rollout = rollout
        self.queue = queue
        self._index = itertools.count()
        self._workers: dict[str, Any] = {}
        self._run_refs: dict[str, Any] = {}
        self._generating = False
        self._latest = latest
        self.replace_dead = replace_dead
        """A worker that dies (generating or loading weights) is replaced and the run goes on; False raises."""
        self._joining: dict[str, Joining] = {}
        self._events: list[PoolEvent] = []
        self._awaited: set[str] = set()
        """Workers a caller waits for (`start`, `add_worker()`): a failed start raises there, it is not restarted."""
        self._removed: set[str] = set()
        """Workers stopped by `remove_worker` or killed as hung (names are never reused): a weight sync in flight
        no longer waits for them."""
        self.heartbeat = Heartbeat(rollout.heartbeat_timeout_s)
        """Finds workers serving the queue that are alive but no longer answer (`rollout.heartbeat_timeout_s`)."""
        self._last_stats: dict[str, dict[str, Any]] = {}
        """Each serving worker's latest `stats()` answer."""
        self.retired: dict[str, dict[str, Any]] = {}
        """The last counters each worker reported before it died or was removed: a run's totals (tokens
        generated, busy seconds, ...) are these plus the serving workers' (`PoolSnapshot.engine_total`)."""
        self.placement_timeout_s = placement_timeout_s
        """A worker whose one-bundle placement group is not placed within this fails to start, naming the shortage."""
        self._groups: dict[str, Any] = {}
        """Each worker's own placement group (so growing this pool never takes the learner's resources)."""
        self._model = model
        self._actor_cls = ray.remote(NodeLocalRolloutWorker)
        self.restarts = RestartBudget(
            rollout.max_restarts_per_engine, rollout.quarantine_failures, rollout.quarantine_window_s
        )
        """Which dead or hung engines are replaced (`rollout.max_restarts_per_engine`, quarantine)."""

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        model_dir: str,
        queue: Any = None,
        latest: Callable[[], PublishedWeights | None] = lambda: None,
        tools: ToolExecutor | None = None,
    ) -> RolloutPool:
        """The run's pool: engines, sampling and reward from `cfg`; engines abort requests certain to exceed
        `buffer.max_staleness` when `buffer.abort_after_lag` says so (`stale_policy: drop`). A preset model from
        the driver's cache travels through the object store to workers on nodes that lack it. `tools` (the tool
        pool's client) runs tools and rewards; None: in each worker's process."""
        return cls(
            str(model_dir),
            cfg.rollout,
            cfg.env,
            queue,
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            seed=cfg.seed,
            abort_after_lag=cfg.buffer.abort_after_lag,
            latest=latest,
            replace_dead=cfg.rollout.replace_dead_workers,
            placement_timeout_s=cfg.cluster.placement_timeout_s,
            model=ship(model_dir),
            tools=tools,
            lora_rank=cfg.learner.lora.rank if cfg.learner.lora is not None else None,
        )

    @property
    def names(self) -> list[str]:
        """Workers serving the queue (not those still joining)."""
        return [n for n in self._workers if n not in self._joining]

    def handle(self, name: str) -> Any:
        return self._workers[name]

    def start(self) -> None:
        """Start `rollout.num_workers` workers and wait until every engine serves."""
        self._spawn([self._new_name() for _ in range(self.rollout.num_workers)])

    @property
    def joining(self) -> list[str]:
        """Workers started but not yet serving (engine starting, or loading the latest weights)."""
        return list(self._joining)

    def start_generation(self) -> None:
        """Every worker starts serving the queue (idempotent)."""
        if self.queue is None:
            raise RuntimeError("the rollout pool has no queue to serve")
        self._generating = True
        for name, handle in self._workers.items():
            if name not in self._run_refs:
                self._run_refs[name] = handle.run.remote()

    def shutdown(self) -> None:
        handles = list(self._workers.items())
        wait_or_say({h.shutdown.remote(): name for name, h in handles}, "shutdown", CONTROL_TIMEOUT_S)
        for _, h in handles:
            ray.kill(h)
        for name in list(self._groups):
            self._release(name)
        self._workers.clear()
        self._run_refs.clear()
        self._generating = False

    # ---------------------------------------------------------------------------------------------
    # Weights

    def update_weights(
        self, buckets: Sequence[Any], version: int, in_flight: bool = True, timeout_s: float = 120.0
    ) -> None:
        """Send the buckets (bytes, or object refs of bytes such as the learner's export) to every engine
        and wait until each reports `version`.

        Raises WeightSyncTimeout / WeightSyncError naming every engine that did not confirm in `timeout_s`.
        Workers added later load `latest()`, not these buckets: publishing is the weight sync's business.
        """
        self.finish_update(self.start_update(buckets, version, in_flight), version, timeout_s)

    def start_update(self, buckets: Sequence[Any], version: int, in_flight: bool = True) -> dict[Any, str]:
        """`update_weights` without the wait: the engines load while the caller goes on; -> the engines'
        load calls (object ref -> worker name), for `finish_update`."""
        refs = [b if isinstance(b, ray.ObjectRef) else ray.put(bytes(b)) for b in buckets]
        return self._start_sync(dict(self._workers), refs, version, in_flight)

    def finish_update(self, calls: dict[Any, str], version: int, timeout_s: float) -> float | None:
        """Wait until every engine of `calls` reports `version`; -> when the last of them began serving it
        (`WeightLoad.served_at`; None if no engine took part). Raises as `update_weights` does. With
        `replace_dead`, an engine that died is not a failure of the sync: it is replaced (the replacement loads
        the latest weights before it serves). An engine that `remove_worker` stopped meanwhile (a scale-down
        while the sync was in flight) is not waited for."""
        calls = {ref: name for ref, name in calls.items() if name not in self._removed}
        if not calls:
            return None

        def drop_hung(waiting: list[Any]) -> list[Any]:  # an engine that hangs meanwhile is replaced, not waited for
            return [ref for ref in waiting if calls[ref] not in self._removed] if self._replace_hung() else waiting

        done, waiting = wait_in_turns(list(calls), timeout_s, drop_hung)
        problems: list[str] = []
        dead: list[str] = []
        served_at: list[float] = []
        for ref in done:
            name = calls[ref]
            try:
                load = ray.get(ref)
            except RayActorError as e:
                if self.replace_dead:
                    dead.append(name)
                else:
                    problems.append(f"{name} died before confirming version {version} ({type(e).__name__})")
                continue
            except Exception as e:
                problems.append(f"{name} failed to load version {version}: {type(e).__name__}: {e}")
                continue
            if load.version != version:
                problems.append(f"{name} reports version {load.version} instead of {version}")
            served_at.append(load.served_at)
        timed_out = [calls[ref] for ref in waiting]
        problems += [f"{name} did not confirm version {version} within {timeout_s}s" for name in timed_out]
        if problems:
            error = WeightSyncTimeout if timed_out else WeightSyncError
            raise error("weight sync failed: " + "; ".join(problems))
        for name in dead:
            self._replace(name)
        return max(served_at, default=None)

    def _start_sync(self, workers: dict[str, Any], refs: list[Any], version: int, in_flight: bool) -> dict[Any, str]:
        return {handle.update_weights.remote(refs, version, in_flight): name for name, handle in workers.items()}

    # ---------------------------------------------------------------------------------------------
    # Scaling and health

    def add_worker(self, wait: bool = True) -> str:
        """Start one more worker; it loads the latest published weights before it serves. With `wait=False`
        it joins later, at a `poll()` (the caller keeps working meanwhile)."""
        name = self._new_name()
        if wait:
            self._spawn([name])
        else:
            self._launch(name)
        return name

    def remove_worker(self, name: str, drain: bool = False) -> int:
        """Stop a worker and hand its unfinished requests back to the queue; returns how many were re-queued.
        A weight sync still in flight to it no longer waits for it (`finish_update`): its engine stops
        mid-load."""
        handle = self._workers.pop(name)
        self._removed.add(name)
        self._run_refs.pop(name, None)
        try:
            ray.get(handle.stop.remote(drain=drain), timeout=CONTROL_TIMEOUT_S)
            self._last_stats[name] = ray.get(handle.stats.remote(), timeout=CONTROL_TIMEOUT_S)
            ray.get(handle.shutdown.remote(), timeout=CONTROL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            pass  # dead or stuck: killed below, its requests re-queued all the same
        ray.kill(handle)
        self._release(name)
        return self._requeue(name)

    def poll(self) -> list[PoolEvent]:
        """Upkeep without waiting, for the controller to call every turn of its loop: a worker whose `run`
        call ended with an actor error is dead — its requests are re-dispatched and (with `replace_dead`) a
        replacement is started; a started worker joins once its engine serves the latest weights."""
        self._maintain()
        events, self._events = self._events, []
        return events

    def _maintain(self) -> None:
        """`poll`'s work; the events stay queued for the next `poll`."""
        for name in self._dead_runners():
            self._replace(name)
        self._replace_hung()
        self._advance_joining()

    def _replace_hung(self) -> list[str]:
        """Kill the workers serving the queue that missed a heartbeat (alive but not answering: stopped, deadlocked)
        and replace them as dead ones are: their requests re-dispatched, a replacement started."""
        hung = self.heartbeat.missed({name: self._workers[name] for name in self._run_refs})
        for name in hung:
            ray.kill(self._workers[name])
            self._removed.add(name)
            self._replace(name, kind="hung", detail=f"no heartbeat answer within {self.heartbeat.timeout_s:g}s")
        return hung

    def _dead_runners(self) -> list[str]:
        refs = {ref: name for name, ref in self._run_refs.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        return [refs[ref] for ref in done if died(ref)]

    def _replace(self, name: str, force: bool = False, kind: str = "died", detail: str = "") -> PoolEvent:
        """`name` died (or, `kind="hung"`, was killed): forget it, re-dispatch its requests, start a replacement
        (with `replace_dead`) unless its slot's restart budget says no (`restarts`): then a `quarantined` event
        follows and the pool runs one engine short."""
        if name not in self._workers:
            return PoolEvent(name, "died")  # already handled (a failed sync and a failed `run` both report it)
        self._workers.pop(name)
        self._run_refs.pop(name, None)
        self._release(name)
        requeued = self._requeue(name)
        if not (self.replace_dead or force):
            raise WorkerDiedError(
                f"rollout worker {name} {'died' if kind == 'died' else 'hung and was killed'} "
                f"(rollout.replace_dead_workers is off); {requeued} requests re-queued"
            )
        return self._restart(PoolEvent(name, kind, requeued=requeued, detail=detail), budget=not force)

    def _restart(self, event: PoolEvent, budget: bool = True, last: str = "was its last engine") -> PoolEvent:
        """Start a replacement taking the slot of the worker `event` reports, unless the slot's restart budget
        (`restarts`) says no: then a `quarantined` event follows and the pool runs one engine short."""
        name = event.worker
        why = self.restarts.failed(name) if budget else None
        if why is not None:
            self._event(event)
            self._event(PoolEvent(self.restarts.slot(name), "quarantined", detail=f"{name} {last}: {why}"))
            return event
        replacement = self._new_name()
        self.restarts.replaced(name, replacement)
        self._launch(replacement)
        return self._event(dataclasses.replace(event, replacement=replacement))

    def _event(self, event: PoolEvent) -> PoolEvent:
        self._events.append(event)
        return event

    def _requeue(self, name: str) -> int:
        if self.queue is None:
            return 0
        return int(
            named_get(
                self.queue.requeue_worker.remote(name), CONTROL_TIMEOUT_S, f"replay queue: requeue_worker({name})"
            )
        )

    def _new_name(self) -> str:
        return f"rollout-{next(self._index)}"

    def _spawn(self, names: list[str]) -> None:
        """Start workers and wait until each serves the latest weights (and, if the pool serves, the queue)."""
        for name in names:
            self._launch(name)
        self._await_joined(names, self.placement_timeout_s + self.rollout.engine_start_timeout_s)

    def _launch(self, name: str) -> None:
        """Create the worker's actor and ask its engine to start; it joins at a later `poll`."""
        spec = dataclasses.replace(
            self.spec, seed=self.spec.seed + int(name.rsplit("-", 1)[1])
        )  # distinct sampling streams
        cfg = self.rollout
        group = self._groups[name] = placement.start(
            "rollout", [placement.bundle(cfg.num_cpus_per_worker, cfg.num_gpus_per_worker, cfg.resources)]
        )
        handle: Any = self._actor_cls.options(
            num_cpus=cfg.num_cpus_per_worker,
            num_gpus=cfg.num_gpus_per_worker,
            max_concurrency=1000,
            scheduling_strategy=placement.in_bundle(group, 0),
        ).remote(name, spec, self.queue, model=self._model)
        self._joining[name] = Joining(handle, handle.ready.remote(), time.monotonic(), placed=group.ready())

    def _await_joined(self, names: list[str], timeout_s: float) -> None:
        self._awaited.update(names)
        try:
            self._await(names, timeout_s)
        finally:
            self._awaited.difference_update(names)

    def _await(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(n in self._joining for n in names):
            failed = [e for e in self._advance_joining() if e.kind == "failed_to_start" and e.worker in names]
            if failed:
                self._abandon([n for n in names if n in self._joining])
                raise WorkerStartError("; ".join(e.detail for e in failed))
            if time.monotonic() > deadline:
                late = [n for n in names if n in self._joining]
                self._abandon(late)
                raise WorkerStartError("; ".join(f"{n} did not start its engine within {timeout_s}s" for n in late))
            time.sleep(0.05)

    def _advance_joining(self) -> list[PoolEvent]:
        """Move each joining worker one stage on, without waiting: engine up -> load latest weights -> serve."""
        events: list[PoolEvent] = []
        for name, j in list(self._joining.items()):
            if not self._placed(name, j, events):
                continue
            ref = j.sync if j.sync is not None else j.ready
            if not ray.wait([ref], timeout=0)[0]:
                if time.monotonic() - j.engine_began > self.rollout.engine_start_timeout_s:
                    events.append(
                        self._failed_start(
                            name, f"{name} did not start its engine within {self.rollout.engine_start_timeout_s}s"
                        )
                    )
                continue
            try:
                ray.get(ref)
            except Exception as e:
                events.append(self._failed_start(name, f"{name} failed to start: {start_failure(e)}"))
                continue
            latest = self._latest()
            if j.sync is None and latest is not None:
                # From now on every weight sync includes this worker, so once this load of the latest weights is
                # done it can never fall behind the admission version: it serves then. (Waiting until it has
                # caught up with a learner that publishes faster than an engine loads would never end.)
                self._workers[name] = j.handle
                j.sync, j.version = j.handle.update_weights.remote(latest.refs, latest.version, False), latest.version
                continue
            events.append(self._join(name))
        return events

    def _placed(self, name: str, j: Joining, events: list[PoolEvent]) -> bool:
        """Whether the worker's placement group is placed; past `placement_timeout_s` it fails to start with
        what the cluster is short of (the engine's own timeout counts only once it has somewhere to run)."""
        if j.placed is None:
            return True
        if ray.wait([j.placed], timeout=0)[0]:
            j.placed, j.engine_began = None, time.monotonic()
            return True
        if time.monotonic() - j.began > self.placement_timeout_s:
            bundles = list(self._groups[name].bundle_specs)
            events.append(
                self._failed_start(
                    name, placement.shortage("rollout", bundles, self.placement_timeout_s, placement.capacity())
                )
            )
        return False

    def _join(self, name: str) -> PoolEvent:
        j = self._joining.pop(name)
        self._workers[name] = j.handle  # already there when it loaded weights (`_advance_joining`)
        if self._generating:
            self._run_refs[name] = j.handle.run.remote()
        return self._event(PoolEvent(name, "joined", version=j.version, seconds=time.monotonic() - j.began))

    def _failed_start(self, name: str, detail: str) -> PoolEvent:
        """`name` did not start. One nobody waits for (a replacement, a scale-up) is restarted like a dead one
        (with `replace_dead`), under its slot's restart budget; past it the slot is quarantined."""
        self._abandon([name])
        event = PoolEvent(name, "failed_to_start", detail=detail)
        if name in self._awaited or not self.replace_dead:
            return self._event(event)
        return self._restart(event, last="failed to start, its last engine")

    def _abandon(self, names: list[str]) -> None:
        for name in names:
            j = self._joining.pop(name, None)
            self._workers.pop(name, None)
            if j is not None:
                ray.kill(j.handle)
            self._release(name)

    def _release(self, name: str) -> None:
        """A worker left the pool (died or removed): free its placement group and retire its counters."""
        if name in self._last_stats:
            self.retired[name] = self._last_stats.pop(name)
        group = self._groups.pop(name, None)
        if group is not None:
            placement.release(group)

    # ---------------------------------------------------------------------------------------------
    # Probes, evaluation, stats

    def serving(self) -> list[str]:
        """The serving workers, after `poll`'s upkeep (its events stay queued for the caller's next `poll`);
        waits, at most `engine_start_timeout_s`, while there is none (the only engine died and its
        replacement is still starting)."""
        deadline = time.monotonic() + self.rollout.engine_start_timeout_s
        self._maintain()
        while not self.names:
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"no rollout worker serves after {self.rollout.engine_start_timeout_s}s (joining: {self.joining})"
                )
            time.sleep(0.1)
            self._maintain()
        return self.names
