"""The run's fleet: the replay queue, the learner, the rollout and tool pools and the weight sync between them.
It starts and stops them, and between steps keeps the rollout pool whole: dead or hung engines replaced (their
requests re-dispatched), the size `asyncrl scale` asked for applied, injected faults fired, each event kept
for the summary and the live views fed."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.cluster.control import JOB_ENV, ControlClient, LocalControl
from asyncrl.config import Config
from asyncrl.controller.faults import kill_oldest_worker
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
        self.tools: ToolPool | None = None
        """The sandboxed tool-worker pool, when the run needs one (`needs_tool_pool`)."""
        self.pool_events: list[dict[str, Any]] = []
        """Rollout workers that died, hung, were killed by fault injection, joined or failed to start."""
        self.rates = RateWindow(cfg.telemetry.rate_window_s)
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
        self.sync = make_weight_sync(self.learner, self.rollout, cfg.weight_sync, cfg.mode)
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
            self.cfg.tools, prefix=f"tool-{self.out.name}", placement_timeout_s=self.cfg.cluster.placement_timeout_s
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

    def request_scale(self, rollout_workers: int) -> int:
        """Ask for a rollout pool of this size (the dashboard's control); `scale` applies it between steps."""
        if rollout_workers < 1:
            raise ValueError(f"rollout pool size must be >= 1 (got {rollout_workers})")
        return self.control.set_rollout(rollout_workers)

    def upkeep(self) -> None:
        """Rollout pool upkeep without waiting: dead workers are replaced (their requests re-dispatched), hung
        ones too once they miss a heartbeat, and started ones join once they serve the latest weights; each
        event is logged and kept for the summary."""
        self.scale()
        self.record_events()
        if time.perf_counter() - self._last_snapshot >= self.cfg.telemetry.pool_every_s:
            self.telemetry.pool(self.snapshot())

    def record_events(self) -> None:
        """The pools' events since the last call (deaths, hangs, replacements, joins), logged and kept."""
        for event in self.rollout.poll():
            self.telemetry.note(str(event))
            self.event(**asdict(event))
        for tool_event in self.tools.poll() if self.tools else ():
            self.telemetry.note(str(tool_event))
            self.event(worker=tool_event.worker, kind=f"tool_{tool_event.kind}", detail=tool_event.detail)

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
                "learner": self.cfg.learner.num_ranks,
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
        """Resize the rollout pool to what `asyncrl scale` asked for: new workers join once they serve the
        latest weights (the learner goes on meanwhile); removed ones hand their requests back."""
        wanted, requested_at = self.control.wanted_rollout()
        have = len(self.rollout.names) + len(self.rollout.joining)
        if wanted is None or wanted == have:
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

    def inject_faults(self) -> None:
        """`faults.kill_rollout_worker_at_steps`: SIGKILL the oldest rollout worker's process now."""
        if self.state.step in self.cfg.faults.kill_rollout_worker_at_steps:
            self.event(kind="killed", worker=kill_oldest_worker(self.rollout))
