"""What a run records: its telemetry sinks, one row per step (metrics.jsonl and the console, in step order),
the steps the learner skipped, and the summary written at the end (summary.json)."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.controller.faults import (
    NonFiniteError,
    learner_scaling_timings,
    recovery_timings,
    scaling_timings,
    write_bad_batch,
)
from asyncrl.telemetry.dashboard import Dashboard
from asyncrl.telemetry.figures import batch_figures
from asyncrl.telemetry.metrics import RunMetrics
from asyncrl.telemetry.progress import Progress
from asyncrl.telemetry.record import EventLog
from asyncrl.telemetry.sinks import Sink, Telemetry, lag_counts

if TYPE_CHECKING:
    from asyncrl.controller.evaluation import Evaluation
    from asyncrl.controller.fleet import Fleet
    from asyncrl.telemetry.alarms import Alarms
    from asyncrl.types import Batch, StepStats


def build_telemetry(cfg: Config) -> Telemetry:
    """The run's sinks, built before anything slow starts so that every start-up phase is shown; the
    dashboard's address is the first thing printed."""
    from asyncrl.controller.mirror import pull_run_files

    t = cfg.telemetry
    out = cfg.make_run_dir()
    pull_run_files(cfg)  # a run resumed from an object store appends to its predecessor's files
    sinks: list[Sink] = [
        Progress(enabled=t.progress, every_steps=t.log_every_steps, max_steps=cfg.learner.max_steps),
        RunMetrics(t.prometheus_port, cfg.algorithm.resolved_names()["correction"], t.bind_host),
        EventLog(out, append=bool(cfg.checkpoint.resume_from)),
    ]
    if t.dashboard_port:
        sinks.append(Dashboard(out.name, t.bind_host, t.dashboard_port, t.resolved_dashboard_token()))
    if t.tensorboard:
        from asyncrl.telemetry.loggers import TensorBoardSink

        sinks.append(TensorBoardSink(out / "tensorboard"))
    if t.wandb is not None:
        from asyncrl.telemetry.loggers import WandbSink

        sinks.append(WandbSink(t.wandb.project, t.wandb.mode, out, out.name, cfg.public_dump()))
    telemetry = Telemetry(sinks)
    for sink in sinks:
        if isinstance(sink, Dashboard):
            # The token goes to the console only: the phase (events.jsonl, the page's notes) names the bare address.
            print(f"dashboard: {sink.page_url}", flush=True)
            telemetry.phase(f"dashboard: {sink.url} (token on the console)  (after the run: asyncrl dash {out})")
    if t.prometheus_port:
        telemetry.phase(f"Prometheus metrics at http://{t.bind_host}:{t.prometheus_port}/metrics")
    return telemetry


@dataclass
class RunState:
    """Where the run stands: the loop advances `step` and `version`; the fleet, the evaluation and the records
    read them (pool events, eval records and rows name the step and version they belong to). The counters are
    what a checkpoint carries over to a resumed run."""

    started: float = field(default_factory=time.perf_counter)
    """`time.perf_counter()` when the loop began: rows, pool events and snapshots count `wall_s` from here."""
    step: int = 0
    version: int = 0
    samples_trained: int = 0
    tokens_trained: int = 0
    prompts_drawn: int = 0
    prompts_dropped_noted: int = 0
    """The count of prompts skipped as too long when the run last said so."""
    learner_wait_s: float = 0.0
    learner_at_version: bool = True
    """Whether the learner's weights are those of `version` (not trained past it): the best policy can only be
    exported then."""


class Records:
    """Step rows in order, skipped steps, and the run's summary."""

    def __init__(self, cfg: Config, out: Path, state: RunState, telemetry: Telemetry) -> None:
        self.cfg, self.out, self.state, self.telemetry = cfg, out, state, telemetry
        self.history: list[dict[str, Any]] = []
        self._unlogged: deque[dict[str, Any]] = deque()
        self.parity: list[float] = []
        self.mismatch_k3: list[float] = []
        self.skipped_steps = 0
        self._skipped_in_row = 0

    def row(self, stats: StepStats, batch: Batch, learner_wait_s: float) -> dict[str, Any]:
        """The step's row (kept, and logged by `log` once its weight sync's timings are in); counts its samples."""
        state = self.state
        state.samples_trained += stats.num_samples
        state.tokens_trained += stats.num_tokens
        rewards = [t.reward for g in batch.groups for t in g.trajectories]
        row = {
            "step": state.step,
            "version": state.version,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "reward": sum(rewards) / max(1, len(rewards)),
            "samples": stats.num_samples,
            "tokens": stats.num_tokens,
            "staleness_mean": batch.staleness_mean,
            "staleness_max": batch.staleness_max,
            "learner_wait_s": learner_wait_s,
            "lag_counts": lag_counts(batch.lags),
            **batch_figures(batch),
            "wall_s": round(time.perf_counter() - state.started, 3),
            **{k: v for k, v in stats.metrics.items()},
        }
        if "mismatch_k3_kl" in stats.metrics:
            self.mismatch_k3.append(stats.metrics["mismatch_k3_kl"])
        self.history.append(row)
        self._unlogged.append(row)
        state.learner_wait_s += learner_wait_s
        return row

    def unlogged_last_row(self) -> dict[str, Any] | None:
        """The last step's row while it is not logged yet (a sync it publishes can still add its timings), else None:
        a logged row never changes, so metrics.jsonl and the live telemetry that was handed it keep the same row."""
        if self._unlogged and self._unlogged[-1] is self.history[-1]:
            return self.history[-1]
        return None

    def log(self, hold: dict[str, Any] | None) -> None:
        """Rows of finished steps, in order, to metrics.jsonl and the console; the row `hold` (its step's weight
        sync is still in flight) and the rows after it wait until the sync's timings are in."""
        while self._unlogged and self._unlogged[0] is not hold:
            row = self._unlogged.popleft()
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            self.telemetry.step(row)

    def check_finite(self, stats: StepStats, batch: Batch) -> None:
        """The learner skips a step whose loss or gradient is not finite (weights and optimizer untouched):
        count it, keep its batch for inspection, and stop after `learner.max_skipped_steps` in a row."""
        if not (stats.metrics.get("skipped_step", 0.0) > 0 or not math.isfinite(stats.loss)):
            self._skipped_in_row = 0
            return
        step = self.state.step
        self.skipped_steps += 1
        self._skipped_in_row += 1
        path = write_bad_batch(self.out, step, batch)
        self.telemetry.note(f"step {step}: non-finite loss or gradient, step skipped; batch kept in {path}")
        if self._skipped_in_row >= self.cfg.learner.max_skipped_steps:
            raise NonFiniteError(
                f"{self._skipped_in_row} steps in a row (the last: step {step}) had a non-finite loss or gradient "
                f"(learner.max_skipped_steps = {self.cfg.learner.max_skipped_steps}); "
                f"their batches are in {path.parent}"
            )

    def summary(
        self,
        wall_s: float,
        fleet: Fleet,
        evaluation: Evaluation,
        alarms: Alarms,
        stopped_early: str | None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The run's summary (summary.json); `data`: a Parquet stream's position and dropped-prompt count."""
        snapshot = fleet.snapshot()
        self.telemetry.pool(snapshot)
        counters, rollout = snapshot.counters, snapshot.engines
        histogram = fleet.queue.staleness_histogram()
        evals, state = evaluation.evals, self.state
        return {
            "mode": self.cfg.mode,
            "algorithm": self.cfg.algorithm.resolved_names(),
            "start_accuracy": evals[0]["accuracy"] if evals else None,
            "final_accuracy": evals[-1]["accuracy"] if evals else None,
            "best_eval": evaluation.best.record,
            "wall_clock_s": round(wall_s, 2),
            "steps": state.step,
            "stopped_early": stopped_early,
            "skipped_steps": self.skipped_steps,
            "final_version": state.version,
            "samples_trained": state.samples_trained,
            "tokens_trained": state.tokens_trained,
            "staleness_histogram": {str(lag): n for lag, n in sorted(histogram.items())},
            "stale_policy": self.cfg.buffer.stale_policy,
            "response_lengths": asdict(fleet.queue.response_lengths()),
            "counters": counters,
            "mismatch_k3_mean": sum(self.mismatch_k3) / len(self.mismatch_k3) if self.mismatch_k3 else None,
            "parity_max_abs_diff_mean": sum(self.parity) / len(self.parity) if self.parity else None,
            "evals": evals,
            "eval_wait_s": round(evaluation.waited_s, 2),
            "evals_straddled": evaluation.straddled,
            "evals_dropped": evaluation.dropped,
            "publishes_deferred": evaluation.publishes_deferred,
            "learner_idle_fraction": state.learner_wait_s / wall_s if wall_s else None,
            "rollout": rollout,
            "rollout_retired": snapshot.retired,
            "pool_events": fleet.pool_events,
            "alarms": [asdict(event) for event in alarms.fired],
            "faults": recovery_timings(fleet.pool_events),
            "scaling": scaling_timings(fleet.pool_events),
            "learner_scaling": learner_scaling_timings(fleet.pool_events),
            "engine_restarts": fleet.rollout.restarts.summary(),
            "tools": fleet.tools.summary() if fleet.tools else None,
            "data": data,
        }
