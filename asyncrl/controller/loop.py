"""The controller: builds the pools from one config and runs a mode's loop.

All three modes share one loop; what differs is configuration the modes imply (docs/architecture.md#modes):
- `sync`: eta = 0, so admission control lets the rollout pool start exactly one batch per version; the
  weight update is blocking. Generate, train, publish, repeat: the baseline.
- `streaming`: eta > 0, group readiness, in-flight weight updates (ScaleRL / PipelineRL).
- `sao`: one trajectory per prompt, ready the moment it finishes; critic + GAE; DIS gate.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.cluster.control import JOB_ENV, ControlClient, LocalControl
from asyncrl.config import Config
from asyncrl.controller.best import BestPolicy
from asyncrl.controller.faults import (
    NonFiniteError,
    kill_oldest_worker,
    poison_batch,
    recovery_timings,
    scaling_timings,
    write_bad_batch,
)
from asyncrl.telemetry.alarms import Alarms
from asyncrl.telemetry.dashboard import Dashboard
from asyncrl.telemetry.figures import batch_figures
from asyncrl.telemetry.metrics import RunMetrics
from asyncrl.telemetry.progress import Progress
from asyncrl.telemetry.rates import RateWindow
from asyncrl.telemetry.record import EventLog
from asyncrl.telemetry.sinks import PoolSnapshot, Sink, SyncEvent, Telemetry, lag_counts

if TYPE_CHECKING:
    from asyncrl.types import Batch
    from asyncrl.weight_sync.base import PendingSync


def build_telemetry(cfg: Config) -> Telemetry:
    """The run's sinks, built before anything slow starts so that every start-up phase is shown; the
    dashboard's address is the first thing printed."""
    t = cfg.telemetry
    out = cfg.run_dir()
    sinks: list[Sink] = [
        Progress(enabled=t.progress, every_steps=t.log_every_steps, max_steps=cfg.learner.max_steps),
        RunMetrics(t.prometheus_port, cfg.algorithm.resolved_names()["correction"], t.bind_host),
        EventLog(out, append=bool(cfg.checkpoint.resume_from)),
    ]
    if t.dashboard_port:
        sinks.append(Dashboard(out.name, t.bind_host, t.dashboard_port))
    if t.tensorboard:
        from asyncrl.telemetry.loggers import TensorBoardSink

        sinks.append(TensorBoardSink(out / "tensorboard"))
    if t.wandb is not None:
        from asyncrl.telemetry.loggers import WandbSink

        sinks.append(WandbSink(t.wandb.project, t.wandb.mode, out, out.name, cfg.dump()))
    telemetry = Telemetry(sinks)
    for sink in sinks:
        if isinstance(sink, Dashboard):
            telemetry.phase(f"dashboard: {sink.url}  (after the run: asyncrl dash {out})")
    if t.prometheus_port:
        telemetry.phase(f"Prometheus metrics at http://{t.bind_host}:{t.prometheus_port}/metrics")
    return telemetry


class Controller:
    def __init__(self, cfg: Config, model_dir: Path, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.out = cfg.run_dir()
        self.version = 0
        self.step = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.evals: list[dict] = []
        self.parity: list[float] = []
        self.mismatch_k3: list[float] = []
        self.history: list[dict] = []
        self._unlogged: deque[dict] = deque()
        self._pending_sync: tuple[PendingSync, dict] | None = None
        """The weight sync in flight: (pending sync, row of the step that published it)."""
        self.prompts_drawn = 0
        self.telemetry = telemetry if telemetry is not None else build_telemetry(cfg)
        self.alarms = Alarms(cfg.telemetry.alarms, self.telemetry, self.request_stop)
        self.telemetry.sinks.append(self.alarms)
        self.rates = RateWindow(cfg.telemetry.rate_window_s)
        self._last_snapshot = 0.0
        self.learner_wait_s = 0.0
        self.skipped_steps = 0
        self._skipped_in_row = 0
        self.control: ControlClient | LocalControl = LocalControl()
        """Wanted pool sizes: a job's control actor (`asyncrl scale`) or, for a local run, the dashboard's."""
        for sink in self.telemetry.sinks:
            if isinstance(sink, Dashboard):
                sink.scaler = self.request_scale
        self.stop_requested: str | None = None
        """Why the run was asked to stop early (a signal); the loop ends at the next step boundary."""
        self.pool_events: list[dict] = []
        """Rollout workers that died, were killed by fault injection, joined or failed to start (`_upkeep`)."""
        self.tools = None
        """The sandboxed tool-worker pool (`ToolPool`), when the run needs one (`needs_tool_pool`)."""
        self._started = time.perf_counter()
        self.eval_s = 0.0
        """Seconds spent in held-out evaluations (the loop waits for them)."""
        self.best = BestPolicy(self.out, cfg.checkpoint.export_best)
        self._learner_at_version = True
        """Whether the learner's weights are those of `self.version` (not trained past it): the best policy can
        only be exported then."""

    # ------------------------------------------------------------------------------------------------
    # Building the pools

    START_IMPORTS = (
        ("transformers", "AutoTokenizer"),
        ("asyncrl.buffer.client", "start_replay_queue"),
        ("asyncrl.envs.data", "eval_prompts"),
        ("asyncrl.learner.pool", "LearnerPool"),
        ("asyncrl.rollout.pool", "RolloutPool"),
        ("asyncrl.weight_sync.transport", "make_weight_sync"),
    )
    """What `start` imports, as (module, first name): torch and transformers' tokenizers, ~6 s on 2 cores.
    `asyncrl.controller.run` imports them while `ray.init` runs."""

    def start(self) -> None:
        from transformers import AutoTokenizer

        from asyncrl.buffer.client import start_replay_queue
        from asyncrl.envs.data import eval_prompts, train_stream
        from asyncrl.learner.pool import LearnerPool
        from asyncrl.rollout.pool import RolloutPool
        from asyncrl.weight_sync.transport import make_weight_sync

        cfg = self.cfg
        self.telemetry.phase("loading the tokenizer and prompts")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompts = train_stream(cfg, self.tokenizer)
        self.eval_set = eval_prompts(cfg, self.tokenizer)
        # The parity probe's fixed sequence: a held-out prompt and its answer (a Parquet run may have no eval set).
        self.probe = self.eval_set[0] if self.eval_set else next(train_stream(cfg, self.tokenizer))
        self.telemetry.phase("starting the replay queue")
        self.queue = start_replay_queue(
            cfg.buffer,
            batch_groups=cfg.learner.prompts_per_step,
            name=f"replay_queue-{self.out.name}",
            log_dir=self.out,
        )
        # The ranks load the model while the engines start (the longest part); `wait_ready` joins them below.
        self.telemetry.phase(f"starting the learner ({cfg.learner.num_ranks} rank(s))")
        self.learner = LearnerPool.from_config(cfg, self.model_dir)
        self._start_tools()
        self.telemetry.phase(f"starting the rollout pool ({cfg.rollout.num_workers} vLLM engine(s))")
        self.rollout = RolloutPool.from_config(
            cfg,
            self.model_dir,
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
        if cfg.checkpoint.resume_from:
            self._resume(cfg.checkpoint.resume_from)
        self._top_up_prompts()
        self.rollout.start_generation()

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
    # The loop (one screen)

    def run(self) -> dict:
        cfg = self.cfg
        start = self._started = time.perf_counter()
        if not self.cfg.checkpoint.resume_from:  # a resumed run goes on appending to its predecessor's rows
            (self.out / "metrics.jsonl").write_text("")
        self._evaluate(start)
        while self.step < cfg.learner.max_steps and not self.stop_requested:
            if cfg.learner.max_wall_s and time.perf_counter() - start > cfg.learner.max_wall_s:
                break
            wait = time.perf_counter()
            batch = self._next_batch()
            if batch is None:
                break  # asked to stop while waiting
            learner_wait_s = time.perf_counter() - wait
            poison_batch(batch, self.step + 1 in cfg.faults.nan_reward_at_steps)
            step = self.learner.start_step(batch.groups, lags=batch.lags)
            self.step += 1
            self._learner_at_version = False
            self._upkeep()  # while the learner trains: its Ray calls leave the step's critical path
            stats = self.learner.finish_step(step)
            self._check_finite(stats, batch)
            self._record(stats, batch, learner_wait_s=learner_wait_s)
            if self.step % cfg.weight_sync.every_steps == 0:
                self._publish()
            if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0:
                self._evaluate(start)
            if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0:
                self._checkpoint()
            self._log_steps()
        self._finish_sync()
        self._log_steps()
        if not self.stop_requested and (not self.evals or self.evals[-1]["version"] != self.version):
            self._evaluate(start)
        self._record_pool_events()  # e.g. a replacement the last evaluation waited for joined meanwhile
        self._checkpoint()
        return self._summary(time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------------
    # Pieces of the loop

    def request_stop(self, reason: str) -> None:
        """Finish at the next step boundary (or batch wait turn), then checkpoint and summarise as usual."""
        self.stop_requested = reason
        self.telemetry.note(f"stopping: {reason}; checkpointing at the next step boundary")

    def request_scale(self, rollout_workers: int) -> int:
        """Ask for a rollout pool of this size (the dashboard's control); `_scale` applies it between steps."""
        if rollout_workers < 1:
            raise ValueError(f"rollout pool size must be >= 1 (got {rollout_workers})")
        return self.control.set_rollout(rollout_workers)

    def _next_batch(self) -> Batch | None:
        """Wait for a batch, topping up prompts meanwhile (filters may discard groups as fast as they finish);
        None when a stop was requested meanwhile."""
        cfg = self.cfg
        if cfg.buffer.max_staleness == 0:
            self._finish_sync()  # the queue admits this step's groups only once the engines confirmed the last sync
        deadline = time.monotonic() + cfg.rollout.request_timeout_s * 2
        while not self.stop_requested:
            self._top_up_prompts()
            timeout = min(2.0, max(0.1, deadline - time.monotonic()))
            try:
                return self.queue.get_batch(cfg.learner.prompts_per_step, self.version, timeout)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                self._upkeep()  # nothing ready yet: a dead engine is a likely cause
        return None

    def _check_finite(self, stats, batch: Batch) -> None:
        """The learner skips a step whose loss or gradient is not finite (weights and optimizer untouched):
        count it, keep its batch for inspection, and stop after `learner.max_skipped_steps` in a row."""
        if not (stats.metrics.get("skipped_step", 0.0) > 0 or not math.isfinite(stats.loss)):
            self._skipped_in_row = 0
            return
        self.skipped_steps += 1
        self._skipped_in_row += 1
        path = write_bad_batch(self.out, self.step, batch)
        self.telemetry.note(f"step {self.step}: non-finite loss or gradient, step skipped; batch kept in {path}")
        if self._skipped_in_row >= self.cfg.learner.max_skipped_steps:
            raise NonFiniteError(
                f"{self._skipped_in_row} steps in a row (the last: step {self.step}) had a non-finite loss or gradient "
                f"(learner.max_skipped_steps = {self.cfg.learner.max_skipped_steps}); their batches are in {path.parent}"
            )

    def _upkeep(self) -> None:
        """Rollout pool upkeep without waiting: dead workers are replaced (their requests re-dispatched) and
        started ones join once they serve the latest weights; each event is logged and kept for the summary."""
        self._scale()
        self._record_pool_events()
        if time.perf_counter() - self._last_snapshot >= self.cfg.telemetry.pool_every_s:
            self.telemetry.pool(self._snapshot())

    def _record_pool_events(self) -> None:
        """The pools' events since the last call (deaths, replacements, joins), logged and kept for the summary."""
        for event in self.rollout.poll():
            self.telemetry.note(str(event))
            self._pool_event(**asdict(event))
        for tool_event in self.tools.poll() if self.tools else ():
            self.telemetry.note(str(tool_event))
            self._pool_event(worker=tool_event.worker, kind=f"tool_{tool_event.kind}", detail=tool_event.detail)

    def _snapshot(self) -> PoolSnapshot:
        """The queue's and engines' state now, for the live views (`telemetry.pool_every_s`)."""
        self._last_snapshot = time.perf_counter()
        snapshot = PoolSnapshot(
            wall_s=self._last_snapshot - self._started,
            version=self.version,
            counters=self.queue.counters(),
            queue=self.queue.stats(),
            engines=self.rollout.stats(),
            retired=dict(self.rollout.retired),
            tokens_trained=self.tokens_trained,
            learner_wait_s=self.learner_wait_s,
            pool_sizes={
                "rollout": len(self.rollout.names),
                "rollout_joining": len(self.rollout.joining),
                "learner": self.cfg.learner.num_ranks,
            },
        )
        return replace(snapshot, live=self.rates.add(snapshot))

    def _pool_event(self, **event) -> None:
        self.pool_events.append(
            {"t_s": round(time.perf_counter() - self._started, 3), "wall": time.time(), "step": self.step, **event}
        )

    def _scale(self) -> None:
        """Resize the rollout pool to what `asyncrl scale` asked for: new workers join once they serve the
        latest weights (the learner goes on meanwhile); removed ones hand their requests back."""
        wanted, requested_at = self.control.wanted_rollout()
        have = len(self.rollout.names) + len(self.rollout.joining)
        if wanted is None or wanted == have:
            return
        self.telemetry.note(f"scaling the rollout pool {have} -> {wanted} at version {self.version}")
        for _ in range(wanted - have):
            self._pool_event(
                kind="scaled_up",
                worker=self.rollout.add_worker(wait=False),
                version=self.version,
                requested_at=requested_at,
            )
        for name in self.rollout.names[::-1][: max(0, have - wanted)]:
            self._pool_event(
                kind="scaled_down",
                worker=name,
                version=self.version,
                requested_at=requested_at,
                requeued=self.rollout.remove_worker(name),
            )

    def _inject_faults(self) -> None:
        """`faults.kill_rollout_worker_at_steps`: SIGKILL the oldest rollout worker's process now."""
        if self.step not in self.cfg.faults.kill_rollout_worker_at_steps:
            return
        self._pool_event(kind="killed", worker=kill_oldest_worker(self.rollout))

    def _top_up_prompts(self) -> None:
        """Keep enough prompts queued for the pool to run (eta + 2) batches ahead."""
        cfg = self.cfg
        want = (cfg.buffer.max_staleness + 2) * cfg.learner.prompts_per_step
        backlog = self.queue.stats()["backlog_groups"]
        if backlog < want:
            batch = [next(self.prompts) for _ in range(want - backlog)]
            self.prompts_drawn += len(batch)
            self.queue.add_prompts(batch, cfg.rollout.samples_per_prompt)

    def _publish(self) -> None:
        """Export the policy as version v+1 and send it to every engine. When the sync overlaps (in-flight
        modes with `weight_sync.overlap`) the learner goes on while the engines load (`_finish_sync` waits);
        a sync whose parity is probed is waited for at once, before the learner's weights move again."""
        self._finish_sync()  # at most one sync in flight: engines take versions in order
        self.version += 1
        self._learner_at_version = True
        self._pending_sync = (self.sync.start(self.version), self.history[-1])
        self._inject_faults()  # a listed step kills an engine while it loads these weights
        probe = self.sync.probes(self.version)
        if probe or not self.sync.overlaps():
            self._finish_sync(probe)

    def _finish_sync(self, probe: bool = False) -> None:
        """Wait for the sync in flight (raises naming the engines that did not confirm), open admission for
        its version, and record it on the row of the step that published it."""
        if self._pending_sync is None:
            return
        pending, row = self._pending_sync
        self._pending_sync = None
        result = self.sync.finish(pending)
        self.queue.set_version(result.version)
        row.update(sync_s=result.seconds, sync_bytes=result.num_bytes)
        parity = None
        if probe:
            began = time.perf_counter()
            parity = self._parity_probe()
            self.parity.append(parity)
            row.update(parity_max_abs_diff=parity, parity_probe_s=time.perf_counter() - began)
        self.telemetry.sync(SyncEvent(result.version, result.seconds, parity, bytes=result.num_bytes))

    def _parity_probe(self) -> float:
        """Max |engine - learner| log-prob on one fixed sequence (invariant 4): under the raw distribution
        and, when the run samples from a processed one (temperature, top-k, top-p), under that too."""
        from asyncrl.algo.sampling import RAW, SamplingDistribution, logprob_gap

        ids = self.probe.prompt_ids + self.tokenizer(self.probe.ground_truth, add_special_tokens=False).input_ids
        plen = len(self.probe.prompt_ids)
        gap = logprob_gap(self.rollout.score(ids, plen), self.learner.score(ids, plen, RAW))
        rollout = self.cfg.rollout
        if SamplingDistribution(rollout.temperature, rollout.top_p, rollout.top_k) != RAW:
            gap = max(gap, logprob_gap(self.rollout.score(ids, plen, processed=True), self.learner.score(ids, plen)))
        return gap

    def _eval_rewards(self, outputs) -> list[list[float]]:
        """rewards[prompt][sample] of `rollout.evaluate`'s results on the held-out set."""
        answers = [
            (p, text, fin) for p, out in zip(self.eval_set, outputs) for text, fin in zip(out.texts, out.finish_reasons)
        ]
        flat = iter(self._score_answers(answers))
        return [[next(flat) for _ in out.texts] for out in outputs]

    def _score_answers(self, answers: list[tuple]) -> list[float]:
        """Rewards of (prompt, text, finish reason) answers: in the sandboxed tool workers when the run has them
        (a user reward never runs in the driver), else here. An answer whose reward fails scores 0."""
        from asyncrl.envs.rewards import resolve_reward
        from asyncrl.envs.tools.base import RewardError, ToolInfraError

        if self.tools is None:
            reward = resolve_reward(self.cfg.env.reward)
            return [
                float(reward(text, p.ground_truth, finish_reason=fin, extra_info=p.extra_info))
                for p, text, fin in answers
            ]
        client, env = self.tools.client(), self.cfg.env

        async def score(prompt, text: str, finish: str) -> float:
            try:
                return await client.reward(
                    env.reward,
                    text,
                    prompt.ground_truth,
                    finish_reason=finish,
                    extra_info=dict(prompt.extra_info),
                    timeout_s=env.reward_timeout_s,
                )
            except (RewardError, ToolInfraError):
                return 0.0

        async def score_all() -> list[float]:
            return await asyncio.gather(*(score(p, text, fin) for p, text, fin in answers))

        return asyncio.run(score_all())

    def _evaluate(self, start: float) -> None:
        """Held-out evaluation of the policy the engines serve. Single-turn tasks: `eval.samples` completions per
        prompt at `eval.temperature` (greedy by default); the engines report the versions every request ran under,
        and an evaluation that straddled a version change is run once more (then recorded with `straddled: true`).
        Multi-turn environments: one greedy episode per prompt, tools and all. A new best is recorded (and with
        `checkpoint.export_best` exported: `controller.best`), its seconds counted with the evaluation's."""
        if not self.eval_set:
            return
        self._finish_sync()  # every engine serves `self.version`
        from asyncrl.envs.base import is_multi_turn

        began = time.perf_counter()
        fields = self._evaluate_episodes() if is_multi_turn(self.cfg.env.name) else self._evaluate_answers()
        record = {"version": self.version, "step": self.step, "samples_trained": self.samples_trained, **fields}
        exporting = time.perf_counter()
        if (
            self.best.offer(record, self.learner.export_hf if self._learner_at_version else None)
            and self.best.record["exported"]
        ):
            record["best_export_s"] = round(time.perf_counter() - exporting, 2)
        ended = time.perf_counter()
        record |= {
            "wall_s": round(ended - start, 2),
            "wall_s_excl_eval": round(began - start - self.eval_s, 2),
            "eval_s": round(ended - began, 2),
        }
        self.eval_s += ended - began
        self.evals.append(record)
        self.telemetry.eval(record)

    def _evaluate_answers(self) -> dict:
        """`eval.samples` completions per prompt at `eval.temperature`, run once more if it straddled a version."""
        from asyncrl.algo.evaluation import score_samples

        for _ in range(2):
            outputs = self.rollout.evaluate(
                self.eval_set,
                max_tokens=self.cfg.rollout.max_tokens,
                temperature=self.cfg.eval.temperature,
                samples=self.cfg.eval.samples,
            )
            served = sorted({v for o in outputs for v in o.versions})
            if served == [self.version]:
                break
        scores = score_samples(self._eval_rewards(outputs))
        return {
            "accuracy": scores.mean_at_k,
            "temperature": self.cfg.eval.temperature,
            "samples": self.cfg.eval.samples,
            "mean_at_k": scores.mean_at_k,
            "pass_at_k": {str(k): v for k, v in scores.pass_at.items()},
            "served_versions": served,
            "straddled": served != [self.version],
        }

    def _evaluate_episodes(self) -> dict:
        """Greedy held-out episodes (tools and all): success, the tool-call rate (episodes that called a tool at
        least once), mean turns and failed episodes for the eval record."""
        scores = self.rollout.evaluate_episodes(self.eval_set, max_tokens=self.cfg.rollout.max_tokens)
        n = max(1, len(scores))
        return {
            "accuracy": sum(s.reward for s in scores) / n,
            "tool_call_rate": sum(s.tool_calls > 0 for s in scores) / n,
            "turns_mean": sum(s.num_turns for s in scores) / n,
            "episodes_failed": sum(s.failure is not None for s in scores),
        }

    def _record(self, stats, batch: Batch, learner_wait_s: float) -> None:
        self.samples_trained += stats.num_samples
        self.tokens_trained += stats.num_tokens
        rewards = [t.reward for g in batch.groups for t in g.trajectories]
        row = {
            "step": self.step,
            "version": self.version,
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
            "wall_s": round(time.perf_counter() - self._started, 3),
            **{k: v for k, v in stats.metrics.items()},
        }
        if "mismatch_k3_kl" in stats.metrics:
            self.mismatch_k3.append(stats.metrics["mismatch_k3_kl"])
        self.history.append(row)
        self._unlogged.append(row)
        self.learner_wait_s += learner_wait_s

    def _log_steps(self) -> None:
        """Rows of finished steps, in order, to metrics.jsonl and the console; a row whose weight sync is still
        in flight (and the rows after it) waits until the sync's timings are in."""
        pending_row = self._pending_sync[1] if self._pending_sync is not None else None
        while self._unlogged and self._unlogged[0] is not pending_row:
            row = self._unlogged.popleft()
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            self.telemetry.step(row)

    def _checkpoint(self) -> None:
        self._finish_sync()  # the queue's version and the engines agree with the checkpointed learner
        folder = self.out / "checkpoints" / f"step-{self.step:06d}"
        queue_state = self.queue.state_dict()
        extra = {
            "step": self.step,
            "version": self.version,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "prompts_drawn": self.prompts_drawn,
            "queue": queue_state,
            "best_eval": self.best.state_dict(),
        }
        self.learner.save_checkpoint(folder, self.version, extra)
        if self.cfg.checkpoint.export_hf:
            self.learner.export_hf(self.out / "final_model")

    def _resume(self, where: str) -> None:
        from asyncrl.learner.checkpoint import STATE_FILE

        folder = Path(where)
        if where == "latest":  # the newest complete one: a checkpoint cut short by a crash has no state file
            folders = sorted(f for f in (self.out / "checkpoints").glob("step-*") if (f / STATE_FILE).is_file())
            if not folders:
                raise FileNotFoundError(
                    f"checkpoint.resume_from=latest: no complete checkpoint under {self.out / 'checkpoints'}"
                )
            folder = folders[-1]
        restored = self.learner.load_checkpoint(folder)
        extra = restored.extra
        self.step, self.version = restored.step, restored.version
        self.samples_trained, self.tokens_trained = extra["samples_trained"], extra["tokens_trained"]
        self.queue.load_state_dict(extra["queue"])
        self.best.load_state_dict(extra.get("best_eval"))  # checkpoints from before it have none
        # The prompt stream is deterministic: skip what the checkpointed run already drew.
        for _ in range(extra["prompts_drawn"]):
            next(self.prompts)
        self.prompts_drawn = extra["prompts_drawn"]
        # Engines start from the model folder; bring them to the checkpointed weights and version.
        self.sync.finish(self.sync.start(self.version, in_flight=False))

    def _summary(self, wall_s: float) -> dict:
        snapshot = self._snapshot()
        self.telemetry.pool(snapshot)
        counters, rollout = snapshot.counters, snapshot.engines
        histogram = self.queue.staleness_histogram()
        return {
            "mode": self.cfg.mode,
            "algorithm": self.cfg.algorithm.resolved_names(),
            "start_accuracy": self.evals[0]["accuracy"] if self.evals else None,
            "final_accuracy": self.evals[-1]["accuracy"] if self.evals else None,
            "best_eval": self.best.record,
            "wall_clock_s": round(wall_s, 2),
            "steps": self.step,
            "stopped_early": self.stop_requested,
            "skipped_steps": self.skipped_steps,
            "final_version": self.version,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "staleness_histogram": {str(lag): n for lag, n in sorted(histogram.items())},
            "stale_policy": self.cfg.buffer.stale_policy,
            "response_lengths": asdict(self.queue.response_lengths()),
            "counters": counters,
            "mismatch_k3_mean": sum(self.mismatch_k3) / len(self.mismatch_k3) if self.mismatch_k3 else None,
            "parity_max_abs_diff_mean": sum(self.parity) / len(self.parity) if self.parity else None,
            "evals": self.evals,
            "learner_idle_fraction": self.learner_wait_s / wall_s if wall_s else None,
            "rollout": rollout,
            "rollout_retired": snapshot.retired,
            "pool_events": self.pool_events,
            "alarms": [asdict(event) for event in self.alarms.fired],
            "faults": recovery_timings(self.pool_events),
            "scaling": scaling_timings(self.pool_events),
            "tools": self.tools.summary() if self.tools else None,
        }
