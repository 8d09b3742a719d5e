"""The run's fleet: the replay queue, the learner, the rollout and tool pools and the weight sync between them.
It starts and stops them, and between steps keeps the rollout pool whole: dead or hung engines replaced (their
requests re-dispatched), the size `asyncrl scale` asked for applied, injected faults fired, each event kept
for the summary and the live views fed."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.cluster.calls import named_get
from asyncrl.cluster.control import JOB_ENV, ControlClient, LocalControl, Wanted
from asyncrl.config import Config
from asyncrl.controller.autoscale import Autoscaler, Figures
from asyncrl.controller.faults import chaos_schedule, end_stopped, signal_worker
from asyncrl.controller.records import RunState
from asyncrl.telemetry.rates import RateWindow
from asyncrl.telemetry.sinks import PoolSnapshot, Telemetry

if TYPE_CHECKING:
    from asyncrl.buffer.client import QueueClient
    from asyncrl.envs.tools.pool import ToolPool
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool
    from asyncrl.weight_sync.base import WeightSync


class Fleet:
    """Owner of the run's actors; `start` builds them, `shutdown` stops them, `upkeep` tends the rollout pool."""

    START_IMPORTS = (
        ("asyncrl.buffer.client", "start_replay_queue"),
        ("asyncrl.learner.pool", "LearnerPool"),
        ("asyncrl.rollout.pool", "RolloutPool"),
        ("asyncrl.weight_sync.transport", "make_weight_sync"),
    )
    """What `start` imports, as (module, first name)."""

    queue: QueueClient
    learner: LearnerPool
    rollout: RolloutPool
    sync: WeightSync

    def __init__(self, cfg: Config, out: Path, state: RunState, telemetry: Telemetry) -> None:
        self.cfg, self.out, self.state, self.telemetry = cfg, out, state, telemetry
        self.control: ControlClient | LocalControl = LocalControl()
        """Wanted pool sizes: a job's control actor (`asyncrl scale`) or, for a local run, the dashboard's."""
        self.wanted = Wanted()
        """The sizes last read from `control`."""
        self.scaled_at: float | None = None
        """When the rollout size request `scale` last took was made: each request is applied once (an engine
        that dies later is the restart policy's business, not a reason to scale again)."""
        self.refused_learner: tuple[int, float | None] | None = None
        """A learner size request (ranks, requested at) that could not be met: not tried again."""
        self.model_dir: Path | None = None
        self.stop_run: Callable[[str], None] = lambda reason: None
        """Asks the run to stop at the next step boundary, with a checkpoint (`Controller.request_stop`)."""
        self.below_minimum = False
        """A pool fell below its minimum of healthy workers: the run stops, the autoscaler no longer grows it."""
        self.tools: ToolPool | None = None
        """The sandboxed tool-worker pool, when the run needs one (`needs_tool_pool`)."""
        self.pool_events: list[dict[str, Any]] = []
        """Rollout workers that died, hung, were killed by fault injection, joined or failed to start."""
        self.rates = RateWindow(cfg.telemetry.rate_window_s)
        faults = cfg.faults
        self.chaos = chaos_schedule(faults.chaos, cfg.learner.max_steps, faults.kill_rollout_worker_at_steps)
        """`faults.chaos`: step -> "kill" | "stop"."""
        self._chaos_rng = random.Random(faults.chaos.seed + 1)
        self._faults_due: list[str] = []
        """Injected faults ("listed", "kill", "stop") whose step came; each fired at a step with a serving engine."""
        self._hit: set[str] = set()
        """Engines fault injection signalled (never picked again)."""
        self.autoscaler = Autoscaler(cfg.rollout.autoscale) if cfg.rollout.autoscale.max else None
        """`rollout.autoscale`: picks the rollout pool's size from each snapshot's figures."""
        self.stopped: dict[str, list[int]] = {}
        """Engines that fault injection SIGSTOPped -> their pids, killed once the pool let go of the engine."""
        self._last_snapshot = 0.0

    # ------------------------------------------------------------------------------------------------
    # Start and shutdown

    def start(self, model_dir: Path) -> None:
        """Start the queue, the learner, the tool pool and the engines; the learner's ranks load the model while
        the engines start (the longest part)."""
        from asyncrl.buffer.client import start_replay_queue
        from asyncrl.learner.pool import LearnerPool
        from asyncrl.rollout.pool import RolloutPool
        from asyncrl.weight_sync.transport import make_weight_sync

        cfg = self.cfg
        self.model_dir = model_dir
        self.telemetry.phase("starting the replay queue")
        self.queue = start_replay_queue(
            cfg.buffer,
            batch_groups=cfg.learner.prompts_per_step,
            name=f"replay_queue-{self.out.name}",
            log_dir=cfg.run_uri(),
            log_store=cfg.storage.store(),
        )
        self.telemetry.phase(f"starting the learner ({cfg.learner.num_ranks} rank(s))")
        self.learner = LearnerPool.from_config(cfg, model_dir)
        self._start_tools()
        self.telemetry.phase(f"starting the rollout pool ({cfg.rollout.num_workers} vLLM engine(s))")
        self.rollout = RolloutPool.from_config(
            cfg,
            str(model_dir),
            queue=self.queue.handle,
            latest=lambda: self.sync.latest(),
            tools=self.tools.client() if self.tools else None,
        )
        self.sync = make_weight_sync(
            self.learner, self.rollout, cfg.weight_sync, cfg.mode, adapter=cfg.learner.lora is not None
        )
        self.rollout.start()
        self.telemetry.phase("engines ready")
        self._tools_ready()
        self.learner.wait_ready()
        self.telemetry.phase("learner ready")
        if os.environ.get(JOB_ENV):  # submitted as a Ray job: `asyncrl scale` reaches this run's control actor
            self.control = ControlClient.start(os.environ[JOB_ENV])

    def _start_tools(self) -> None:
        """Launch the tool workers; they start while the engines do (`_tools_ready` waits for them)."""
        from asyncrl.envs.tools.pool import ToolPool, needs_tool_pool

        if not needs_tool_pool(self.cfg):
            return
        self.telemetry.phase(f"starting the tool pool ({self.cfg.tools.num_workers} sandboxed worker(s))")
        self.tools = ToolPool(
            self.cfg.tools,
            prefix=f"tool-{self.out.name}",
            placement_timeout_s=self.cfg.cluster.placement_timeout_s,
            rewards=[self.cfg.env.reward],
        )
        self.tools.launch()

    def _tools_ready(self) -> None:
        """Wait for the tool workers before any trajectory calls them, and say once what isolation they get."""
        if self.tools is None:
            return
        self.tools.wait_ready()
        self.telemetry.phase("tool pool ready")
        self.telemetry.note(str(self.tools.capabilities))

    def shutdown(self) -> None:
        """Stop every part even when one fails, then raise the first failure: a dead learner rank must not
        leave the engines running or the queue's trajectory log without its Parquet footer (unreadable)."""
        for name in list(self.stopped):
            self._end_stopped(name)
        parts = [getattr(self, name, None) for name in ("rollout", "tools", "learner", "sync")]
        closers = [part.shutdown for part in parts if part is not None]
        if getattr(self, "queue", None) is not None:
            closers.append(self.queue.close)
        errors = []
        for close in closers:
            try:
                close()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------------------------------------
    # Upkeep between steps

    def request_scale(self, pool: str, size: int) -> int:
        """Ask for a rollout pool of `size` workers or a learner of `size` ranks (the dashboard's control);
        `scale` applies the first between steps, `Controller._resize_learner` the second at a step boundary."""
        if pool == "rollout" and 1 <= size < self.cfg.rollout.min_healthy_engines:  # below 1: `set_size` says
            raise ValueError(self._scale_refusal(size))
        return self.control.set_size(pool, size)

    def _scale_refusal(self, size: int) -> str:
        minimum = self.cfg.rollout.min_healthy_engines
        return f"rollout={size} is below rollout.min_healthy_engines = {minimum}: refused, the pool keeps its size"

    def upkeep(self) -> None:
        """Rollout pool upkeep without waiting: dead workers are replaced (their requests re-dispatched), hung
        ones too once they miss a heartbeat, and started ones join once they serve the latest weights; each
        event is logged and kept for the summary."""
        self.scale()
        self.record_events()
        if time.perf_counter() - self._last_snapshot >= self.cfg.telemetry.pool_every_s:
            snapshot = self.snapshot()
            self.telemetry.pool(snapshot)
            self.autoscale(snapshot)

    def record_events(self) -> None:
        """The pools' events since the last call (deaths, hangs, replacements, joins), logged and kept."""
        for event in self.rollout.poll():
            self.telemetry.note(str(event))
            self.event(**asdict(event))
            if event.kind in ("hung", "died"):
                self._end_stopped(event.worker)
            if event.kind == "quarantined":
                self._check_healthy()
        for tool_event in self.tools.poll() if self.tools else ():
            self.telemetry.note(str(tool_event))
            self.event(worker=tool_event.worker, kind=f"tool_{tool_event.kind}", detail=tool_event.detail)
            if tool_event.kind == "quarantined":
                self._check_healthy()

    def _check_healthy(self) -> None:
        """After an engine slot or a tool worker was quarantined: stop the run (checkpoint at the next step
        boundary) when fewer engines than `rollout.min_healthy_engines` (tool workers than
        `tools.min_healthy_workers`) are left, or none, naming the quarantined ones."""
        pools = [("rollout engine", "rollout.min_healthy_engines", self.cfg.rollout.min_healthy_engines,
                  len(self.rollout.names) + len(self.rollout.joining), self.rollout.restarts.quarantined)]  # fmt: skip
        if self.tools is not None:
            tools = self.cfg.tools
            pools.append(("tool worker", "tools.min_healthy_workers", tools.min_healthy_workers,
                          self.tools.healthy, self.tools.restarts.quarantined))  # fmt: skip
        for what, key, wanted, left, quarantined in pools:
            if left < max(wanted, 1):
                named = "; ".join(f"{name}: {why}" for name, why in quarantined.items())
                self.below_minimum = True
                self.stop_run(f"{left} healthy {what}(s) left, below {key} = {wanted} (quarantined: {named})")
                return

    def snapshot(self) -> PoolSnapshot:
        """The queue's and engines' state now, for the live views (`telemetry.pool_every_s`)."""
        self._last_snapshot = time.perf_counter()
        state = self.state
        snapshot = PoolSnapshot(
            wall_s=self._last_snapshot - state.started,
            version=state.version,
            counters=self.queue.counters(),
            queue=self.queue.stats(),
            engines=self.rollout.stats(),
            retired=dict(self.rollout.retired),
            tokens_trained=state.tokens_trained,
            learner_wait_s=state.learner_wait_s,
            pool_sizes={
                "rollout": len(self.rollout.names),
                "rollout_joining": len(self.rollout.joining),
                "learner": self.learner.num_ranks,
            },
        )
        return replace(snapshot, live=self.rates.add(snapshot))

    def event(self, **event: Any) -> None:
        """Keep a pool event for the summary, stamped with the run's clock and step (`wall`: when it happened,
        if the pool says so, else now)."""
        wall = event.pop("wall", None) or time.time()
        t_s = time.perf_counter() - self.state.started - (time.time() - wall)
        self.pool_events.append({"t_s": round(t_s, 3), "wall": wall, "step": self.state.step} | event)

    def scale(self) -> None:
        """Read the wanted sizes (at most every `control.POLL_S` from a job's control actor) and resize the
        rollout pool to what `asyncrl scale` asked for: new workers join once they serve the latest weights (the
        learner goes on meanwhile); removed ones hand their requests back. The learner's size is applied by the
        controller at a step boundary (`learner_resize`)."""
        polled = self.control.poll()
        if polled is None:
            return
        self.wanted = polled
        wanted, requested_at = self.wanted.rollout, self.wanted.rollout_at
        if wanted is None or requested_at == self.scaled_at:
            return
        self.scaled_at = requested_at
        if wanted < self.cfg.rollout.min_healthy_engines:  # `asyncrl scale` reaches the control actor directly
            self.event(kind="scale_refused", worker="rollout", size=wanted, requested_at=requested_at)
            self.telemetry.note(self._scale_refusal(wanted))
            return
        have = len(self.rollout.names) + len(self.rollout.joining)
        if wanted == have:
            return
        version = self.state.version
        self.telemetry.note(f"scaling the rollout pool {have} -> {wanted} at version {version}")
        for _ in range(wanted - have):
            self.event(
                kind="scaled_up", worker=self.rollout.add_worker(wait=False), version=version, requested_at=requested_at
            )
        for name in self.rollout.names[::-1][: max(0, have - wanted)]:
            self.event(
                kind="scaled_down",
                worker=name,
                version=version,
                requested_at=requested_at,
                requeued=self.rollout.remove_worker(name),
            )

    def autoscale(self, snapshot: PoolSnapshot) -> None:
        """`rollout.autoscale`: ask for the size the policy picks from `snapshot` (as `asyncrl scale` does; `scale`
        applies it), on a cluster asking Ray's autoscaler for the engines' bundles first; logged and kept."""
        if self.autoscaler is None or self.below_minimum:
            return
        size = len(self.rollout.names) + len(self.rollout.joining)
        figures = Figures.of(snapshot)
        if self.rollout.joining:  # a change still settling: the cool-down counts from when the engine serves
            self.autoscaler.hold(figures.wall_s)
        decision = self.autoscaler.decide(size, figures)
        if decision is None:
            return
        rollout = self.cfg.rollout
        if rollout.autoscale.request_resources and (os.environ.get("RAY_ADDRESS") or os.environ.get(JOB_ENV)):
            from asyncrl.cluster import placement

            unit = placement.bundle(rollout.num_cpus_per_worker, rollout.num_gpus_per_worker, rollout.resources)
            placement.request_capacity([unit] * decision.size)
        self.control.set_size("rollout", decision.size)
        self.event(kind="autoscale", worker="rollout", from_size=size, size=decision.size, reason=decision.reason)
        self.telemetry.note(f"autoscale: rollout pool {size} -> {decision.size} ({decision.reason})")

    def learner_resize(self) -> tuple[int, float | None] | None:
        """(ranks, requested at) when `asyncrl scale` asked for a learner of another size, else None."""
        ranks, at = self.wanted.learner, self.wanted.learner_at
        if ranks is None or ranks == self.learner.num_ranks or (ranks, at) == self.refused_learner:
            return None
        return ranks, at

    def reform_learner(self, ranks: int, folder: str | Path, version: int) -> str | None:
        """Replace the learner pool by one of `ranks` ranks restored from the checkpoint `folder` (re-sharded)
        and point the weight sync at it; the rollout pool and the queue are not touched. A size the config
        refuses changes nothing; a pool that cannot start (no room for its ranks) is replaced by one of the old
        size, restored the same way. -> None, or why the size was not taken (the request is then not retried)."""
        from asyncrl.learner.pool import LearnerPool, resized_config

        old = self.learner.num_ranks
        try:
            resized_config(self.cfg.learner, ranks)
        except ValueError as e:
            return str(e)
        self.learner.shutdown()  # frees its placement group: the new ranks may need the same CPUs/GPUs
        why = None
        try:
            self.learner = LearnerPool.from_config(self.cfg, self.model_dir or "", num_ranks=ranks)
            self.learner.wait_ready()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            self.telemetry.note(f"the learner pool of {ranks} ranks did not start ({why}); going back to {old}")
            with contextlib.suppress(Exception):
                self.learner.shutdown()
            self.learner = LearnerPool.from_config(self.cfg, self.model_dir or "", num_ranks=old)
            self.learner.wait_ready()
        self.learner.load_checkpoint(folder)
        self.sync.rewire(self.learner, version)
        return why

    def inject_faults(self) -> None:
        """Fire the faults due at this step, at most one per step: `faults.kill_rollout_worker_at_steps` SIGKILLs the
        oldest serving engine's process, `faults.chaos` SIGKILLs or SIGSTOPs one chosen at random. A fault whose
        step comes while no engine serves (all hit ones are being replaced; the learner trains on what the queue
        holds) waits for the next step that has one."""
        step = self.state.step
        if step in self.cfg.faults.kill_rollout_worker_at_steps:
            self._faults_due.append("listed")
        if step in self.chaos:
            self._faults_due.append(self.chaos[step])
        if not self._faults_due:
            return
        serving = [n for n in self.rollout.names if n not in self._hit]
        if not serving:
            self.telemetry.note(f"fault injection: no serving engine at step {step}; deferred")
            return
        due = self._faults_due.pop(0)
        name = serving[0] if due == "listed" else self._chaos_rng.choice(sorted(serving))
        pid = named_get(self.rollout.handle(name).ready.remote(), 30, f"rollout worker {name}: ready")["pid"]
        self._hit.add(name)
        signalled = signal_worker(pid, "kill" if due == "listed" else due)
        if due == "stop":
            self.stopped[name] = signalled
        self.event(kind="killed" if due == "listed" else f"chaos_{due}", worker=name, pids=signalled)
        self.telemetry.note(f"fault injection: {'SIGSTOP' if due == 'stop' else 'SIGKILL'} of {name} ({signalled})")

    def _end_stopped(self, name: str) -> None:
        """The pool let go of an engine that fault injection stopped: kill its stopped processes."""
        end_stopped(self.stopped.pop(name, []))
