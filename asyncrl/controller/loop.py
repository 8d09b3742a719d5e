"""The controller: builds the run's parts from one config and runs a mode's loop.

All three modes share one loop; what differs is configuration the modes imply (docs/architecture.md#modes):
- `sync`: eta = 0, so admission control lets the rollout pool start exactly one batch per version; the
  weight update is blocking. Generate, train, publish, repeat: the baseline.
- `streaming`: eta > 0, group readiness, in-flight weight updates (ScaleRL / PipelineRL).
- `sao`: one trajectory per prompt, ready the moment it finishes; critic + GAE; DIS gate.

The loop owns the policy version, the weight sync in flight, checkpoints and resume; the fleet (`fleet.py`) owns
the actors, the evaluation (`evaluation.py`) the held-out scores, the records (`records.py`) rows and summary.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.buffer.starvation import Starvation, StarvedError, starved_message
from asyncrl.config import Config
from asyncrl.controller.evaluation import Evaluation
from asyncrl.controller.faults import poison_batch
from asyncrl.controller.fleet import Fleet
from asyncrl.controller.mirror import RunMirror
from asyncrl.controller.records import Records, RunState, build_telemetry
from asyncrl.envs.parquet import ParquetPrompts
from asyncrl.remote import is_remote, join
from asyncrl.telemetry.alarms import Alarms
from asyncrl.telemetry.dashboard import Dashboard
from asyncrl.telemetry.sinks import AlarmEvent, SyncEvent, Telemetry

if TYPE_CHECKING:
    from asyncrl.types import Batch, Prompt, StepStats
    from asyncrl.weight_sync.base import PendingSync

__all__ = ["Controller", "SyncInFlight", "build_telemetry"]


@dataclass(frozen=True)
class SyncInFlight:
    """The weight sync the engines are loading. At most one is in flight (engines take versions in order):
    `Controller._publish` opens it, `Controller._close_sync` closes it."""

    pending: PendingSync
    row: dict[str, Any] | None
    """The row of the step that published it: the sync's timings go there, so that row (and the rows after it)
    are logged only once the engines confirmed. None when that row was logged already (a publication held back
    by an evaluation): the timings are then in the sync event only."""
    probe: bool
    """Whether the engine-learner parity is probed once the engines confirmed."""


class Controller:
    """One run: `start` builds its parts, `run` trains until `learner.max_steps` (or a stop) and returns the
    summary, `shutdown` stops every part. The run's position (`state`) is shared with its collaborators: the
    `fleet` (actors), the `evaluation` and the `records`."""

    START_IMPORTS = (
        ("transformers", "AutoTokenizer"),
        ("asyncrl.envs.data", "eval_prompts"),
        *Fleet.START_IMPORTS,
    )
    """What `start` and `Fleet.start` import, as (module, first name): torch and transformers' tokenizers, ~6 s
    on 2 cores. `asyncrl.controller.run` imports them while `ray.init` runs."""

    def __init__(self, cfg: Config, model_dir: Path, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.state = RunState()
        self.telemetry = telemetry if telemetry is not None else build_telemetry(cfg)
        out = cfg.run_dir()
        self.records = Records(cfg, out, self.state, self.telemetry)
        self.fleet = Fleet(cfg, out, self.state, self.telemetry)
        self.evaluation = Evaluation(cfg, out, self.fleet, self.state, self.telemetry)
        self.alarms = Alarms(cfg.telemetry.alarms, self.telemetry, self.request_stop)
        self.fleet.stop_run = self.request_stop
        self.telemetry.sinks.append(self.alarms)
        self.mirror: RunMirror | None = None
        """Uploads the driver's files when the run folder is on an object store (the last sink: its close
        uploads what the others wrote last)."""
        if cfg.storage.uri is not None and is_remote(cfg.storage.uri):
            self.mirror = RunMirror(cfg, self.telemetry.note, self.request_stop)
            self.telemetry.sinks.append(self.mirror)
        for sink in self.telemetry.sinks:
            if isinstance(sink, Dashboard):
                sink.scaler = self.fleet.request_scale
        self.in_flight: SyncInFlight | None = None
        """The weight sync in flight, if any."""
        self.prompts: Iterator[Prompt] = iter(())
        """The training prompt stream (deterministic: a resumed run skips what its predecessor drew)."""
        self.stop_requested: str | None = None
        """Why the run was asked to stop early (a signal); the loop ends at the next step boundary."""
        self.starved_groups_noted = 0
        """Groups in a row filtered when the learner's starvation was last noted (0: not starved)."""
        self.publish_deferred = False
        """Whether a weight publication waits for the evaluation in flight (`eval.blocking: false`)."""
        self.resized: dict[str, Any] | None = None
        """The learner resize whose first step on the new pool has not finished yet."""

    def start(self) -> None:
        """Load the tokenizer and prompts, start the fleet, resume if asked, and let the engines generate."""
        from transformers import AutoTokenizer

        from asyncrl.envs.data import eval_prompts, probe_prompt, train_stream

        cfg = self.cfg
        if self.mirror is not None:
            self.mirror.start()
        self.telemetry.phase("loading the tokenizer and prompts")
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompts = train_stream(cfg, tokenizer)
        eval_set = self.evaluation.eval_set = eval_prompts(cfg, tokenizer)
        # The parity probe's fixed sequence: a held-out prompt and its answer (a Parquet run may have no eval set).
        probe = eval_set[0] if eval_set else probe_prompt(cfg, tokenizer, self.prompts)
        answer = tokenizer(probe.ground_truth, add_special_tokens=False).input_ids
        self.evaluation.probe = (probe.prompt_ids + answer, len(probe.prompt_ids))
        self.fleet.start(self.model_dir)
        if cfg.checkpoint.resume_from:
            self._resume(cfg.checkpoint.resume_from)
        self._top_up_prompts()
        self.fleet.rollout.start_generation()

    def shutdown(self) -> None:
        """Stop every part (`Fleet.shutdown`), upload what the driver wrote (`RunMirror.finish`), then give the
        run's files `storage.mode`'s modes."""
        try:
            self.fleet.shutdown()
        finally:
            try:
                if self.mirror is not None:
                    self.mirror.finish()
            finally:
                self.cfg.seal_run_dir()

    # ------------------------------------------------------------------------------------------------
    # The loop (one screen)

    def run(self) -> dict[str, Any]:
        cfg, state = self.cfg, self.state
        start = state.started = time.perf_counter()
        if not cfg.checkpoint.resume_from:  # a resumed run goes on appending to its predecessor's rows
            (self.records.out / "metrics.jsonl").write_text("")
        self._evaluate(start, wait=True)  # the learner has no batch yet: the engines generate the first beside it
        while state.step < cfg.learner.max_steps and not self.stop_requested:
            if cfg.learner.max_wall_s and time.perf_counter() - start > cfg.learner.max_wall_s:
                break
            wait = time.perf_counter()
            batch = self._next_batch()
            if batch is None:
                break  # asked to stop while waiting
            learner_wait_s = time.perf_counter() - wait
            poison_batch(batch, state.step + 1 in cfg.faults.nan_reward_at_steps)
            step = self.fleet.learner.start_step(batch.groups, lags=batch.lags)
            state.step += 1
            state.learner_at_version = False
            self.fleet.upkeep()  # while the learner trains: its Ray calls leave the step's critical path
            time.sleep(cfg.faults.learner_delay(state.step))  # a learner made slow for a test (0: none)
            self._record(self.fleet.learner.finish_step(step), batch, learner_wait_s)
            self._first_step_after_resize()
            if state.step % cfg.weight_sync.every_steps == 0:
                self._publish_unless_evaluating()
            self._collect_evaluation(wait=False)  # an evaluation that is in: recorded, a held-back publication made
            if cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0:
                self._evaluate(start)
            if cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0:
                self._checkpoint()
            self._log_steps()
            if (resize := self.fleet.learner_resize()) is not None and state.step < cfg.learner.max_steps:
                self._resize_learner(*resize)
        self._close_sync()
        self._log_steps()
        self._last_evaluation(start)
        self.fleet.record_events()  # e.g. a replacement the last evaluation waited for joined meanwhile
        self._checkpoint()
        return self.records.summary(
            time.perf_counter() - start,
            self.fleet,
            self.evaluation,
            self.alarms,
            self.stop_requested,
            self._data_position(),
        )

    # ------------------------------------------------------------------------------------------------
    # Pieces of the loop

    def request_stop(self, reason: str) -> None:
        """Finish at the next step boundary (or batch wait turn), then checkpoint and summarise as usual."""
        self.stop_requested = reason
        self.telemetry.note(f"stopping: {reason}; checkpointing at the next step boundary")

    def _next_batch(self) -> Batch | None:
        """Wait for a batch, topping up prompts meanwhile (filters may discard groups as fast as they finish);
        None when a stop was requested meanwhile."""
        cfg = self.cfg
        if cfg.buffer.staleness.synchronous:
            self._close_sync()  # the queue admits this step's groups only once the engines confirmed the last sync
        began = time.monotonic()
        deadline = began + cfg.rollout.request_timeout_s * 2
        while not self.stop_requested:
            self._top_up_prompts()
            # Held-back weights or a sync in flight: look again soon (at the evaluation, or to close the sync).
            turn = 0.1 if self.publish_deferred or self.in_flight is not None else 2.0
            timeout = min(turn, max(0.1, deadline - time.monotonic()))
            try:
                batch = self.fleet.queue.get_batch(cfg.learner.prompts_per_step, self.state.version, timeout)
            except TimeoutError as e:
                if self.publish_deferred:  # the batch may need the held-back weights: made once the evaluation is in
                    if self.evaluation.ready():
                        self._collect_evaluation(wait=True)
                        self._close_sync()  # admission opens for the new version once the engines confirmed it
                        deadline = time.monotonic() + cfg.rollout.request_timeout_s * 2
                    continue
                if self.in_flight is not None:  # steps trained while a publication was held back used up the
                    self._close_sync()  # admission window: it reopens once the engines confirm the sync
                    continue
                starvation = self._watch_starvation()
                if time.monotonic() >= deadline:
                    if starvation.starved(cfg.learner.prompts_per_step):
                        raise StarvedError(starved_message(starvation, time.monotonic() - began)) from e
                    raise
                self.fleet.upkeep()  # nothing ready yet: a dead or hung engine is a likely cause
                continue
            self._watch_starvation(fed=True)
            return batch
        return None

    def _watch_starvation(self, fed: bool = False) -> Starvation:
        """While the learner waits: say once (and again each time the count doubles) that every recent group was
        filtered, as a note and a `starved` alarm; clear the alarm once a group became ready or a batch came (`fed`).
        """
        starvation = Starvation() if fed else self.fleet.queue.starvation()
        count, threshold = starvation.groups_since_ready, self.cfg.learner.prompts_per_step
        if not starvation.starved(threshold):
            if self.starved_groups_noted:
                self.starved_groups_noted = 0
                self.telemetry.alarm(AlarmEvent("starved", count, threshold, "no longer starved", active=False))
        elif count >= 2 * self.starved_groups_noted:
            message = f"learner starved: {starvation.describe()} — {starvation.advice()}"
            self.telemetry.note(message)
            if not self.starved_groups_noted:
                self.telemetry.alarm(AlarmEvent("starved", count, threshold, message))
            self.starved_groups_noted = count
        return starvation

    def _record(self, stats: StepStats, batch: Batch, learner_wait_s: float) -> None:
        """The step's outcome: a skipped step counted (too many in a row stop the run), its row kept."""
        self.records.check_finite(stats, batch)
        self.records.row(stats, batch, learner_wait_s)

    def _log_steps(self) -> None:
        self.records.log(hold=self.in_flight.row if self.in_flight is not None else None)

    def _top_up_prompts(self) -> None:
        """Keep enough prompts queued for the pool to run (eta + 2) batches ahead."""
        cfg = self.cfg
        want = cfg.buffer.staleness.prompts_ahead(cfg.learner.prompts_per_step)
        backlog = self.fleet.queue.backlog_groups()
        if backlog < want:
            batch = [next(self.prompts) for _ in range(want - backlog)]
            self.state.prompts_drawn += len(batch)
            self.fleet.queue.add_prompts(batch, cfg.rollout.samples_per_prompt)
            self._note_dropped_prompts()

    def _note_dropped_prompts(self) -> None:
        """Say when a Parquet stream first skipped prompts longer than `data.max_prompt_tokens`, and again each
        time the count doubles (the count is in summary.json's `data`)."""
        dropped = getattr(self.prompts, "dropped", 0)
        if dropped and dropped >= 2 * self.state.prompts_dropped_noted:
            self.state.prompts_dropped_noted = dropped
            self.telemetry.note(
                f"{dropped} prompt(s) skipped so far: longer than data.max_prompt_tokens "
                f"({getattr(self.prompts, 'max_prompt_tokens', '?')} tokens)"
            )

    def _evaluate(self, start: float, wait: bool = False) -> None:
        """Start a held-out evaluation of the run's version: waited for with `eval.blocking` (or `wait`), else
        collected at a later step boundary (`_collect_evaluation`). One still in flight (it outlasted
        `eval.every_steps`) is waited for first, and the publication it held back made."""
        evaluation = self.evaluation
        if not evaluation.eval_set:
            return
        self._collect_evaluation(wait=True)
        self._close_sync()  # every engine serves the run's version
        if self.cfg.eval.blocking or wait:
            self._evaluate_waited(start, alone=self.cfg.eval.blocking)
        else:
            evaluation.start(start)

    def _evaluate_waited(self, start: float, alone: bool) -> None:
        """One evaluation the loop waits for; `alone`: the queue starts no new group meanwhile, so the engines
        serve it alone (rollouts already started finish) and no rollout for training starts in the time the run's
        clock without evaluations leaves out."""
        if not alone:
            self.evaluation.run(start)
            return
        self.fleet.queue.hold_admission(True)
        try:
            self.evaluation.run(start)
        finally:
            self.fleet.queue.hold_admission(False)

    def _collect_evaluation(self, wait: bool) -> None:
        """Record the evaluation in flight if it is in (or, with `wait`, once it is), then make the weight
        publication it held back, if any."""
        if self.evaluation.pending is None or not (wait or self.evaluation.ready()):
            return
        self.evaluation.finish(self.state.started)
        if self.publish_deferred:
            self._publish(advance=False)

    def _publish_unless_evaluating(self) -> None:
        """Publish, or hold the publication back while an evaluation is in flight (it stays pinned to its version):
        the learner's version advances all the same, the engines stay behind it (as under a slow sync, so the
        staleness bound and admission count the steps trained meanwhile) until `_publish(advance=False)`."""
        if self.evaluation.pending is None:
            self._publish()
        else:
            self.state.version += 1
            self.state.learner_at_version = True
            self.publish_deferred = True
            self.evaluation.defer_publish()

    def _last_evaluation(self, start: float) -> None:
        """At the run's end: the evaluation in flight recorded (dropped, with a note, when the run was stopped), the
        publication it held back made, and the final version evaluated if it was not (waited for)."""
        evaluation, state = self.evaluation, self.state
        if self.stop_requested:
            evaluation.drop()
            return
        self._collect_evaluation(wait=True)
        self._close_sync()
        evals = evaluation.evals
        if evaluation.eval_set and (not evals or evals[-1]["version"] != state.version):
            self._evaluate_waited(start, alone=True)  # nothing will train on rollouts started now

    # ------------------------------------------------------------------------------------------------
    # The weight sync in flight

    def _publish(self, advance: bool = True) -> None:
        """Export the policy as version v+1 (`advance=False`: as the version v it already is, a publication held
        back) and send it to every engine. When the sync overlaps (in-flight modes with `weight_sync.overlap`) the
        learner goes on while the engines load (`_close_sync` waits); a sync whose parity is probed is waited for
        at once, before the learner's weights move again."""
        self._close_sync()  # at most one sync in flight: engines take versions in order
        self.publish_deferred = False
        sync, state = self.fleet.sync, self.state
        state.version += advance
        state.learner_at_version = True
        row = self.records.unlogged_last_row()
        self.in_flight = SyncInFlight(sync.start(state.version), row, sync.probes(state.version))
        self.fleet.inject_faults()  # a listed step kills an engine while it loads these weights
        if self.in_flight.probe or not sync.overlaps():
            self._close_sync()

    def _close_sync(self) -> None:
        """Wait for the sync in flight, if any (raises naming the engines that did not confirm), open admission
        for its version, and record it on the row of the step that published it."""
        if self.in_flight is None:
            return
        closing, self.in_flight = self.in_flight, None
        result = self.fleet.sync.finish(closing.pending)
        self.fleet.queue.set_version(result.version)
        timings: dict[str, Any] = {"sync_s": result.seconds, "sync_bytes": result.num_bytes}
        parity = None
        if closing.probe:
            began = time.perf_counter()
            parity = self.evaluation.parity()
            self.records.parity.append(parity)
            timings.update(parity_max_abs_diff=parity, parity_probe_s=time.perf_counter() - began)
        if closing.row is not None:
            closing.row.update(timings)
        self.telemetry.sync(SyncEvent(result.version, result.seconds, parity, bytes=result.num_bytes))

    # ------------------------------------------------------------------------------------------------
    # Checkpoint and resume

    def _checkpoint(self, export: bool = True) -> str | Path:
        """Write `checkpoints/step-NNNNNN` (and, with `checkpoint.export_hf` and `export`, the HF model); -> the
        folder."""
        self._close_sync()  # the queue's version and the engines agree with the checkpointed learner
        state, fleet = self.state, self.fleet
        folder = self._location("checkpoints", f"step-{state.step:06d}")
        extra = {
            "step": state.step,
            "version": state.version,
            "samples_trained": state.samples_trained,
            "tokens_trained": state.tokens_trained,
            "prompts_drawn": state.prompts_drawn,
            "data": self._data_position(),
            "queue": fleet.queue.state_dict(),
            "best_eval": self.evaluation.best.state_dict(),
        }
        fleet.learner.save_checkpoint(folder, state.version, extra)
        if export and self.cfg.checkpoint.export_hf:
            fleet.learner.export_hf(self._location("final_model"))
        return folder

    # ------------------------------------------------------------------------------------------------
    # Learner resize (`asyncrl scale JOB learner=N`)

    def _resize_learner(self, ranks: int, requested_at: float | None) -> None:
        """At a step boundary: checkpoint, replace the learner pool by one of `ranks` ranks restored from that
        checkpoint (re-sharded), point the weight sync at it, and go on at the same step and version. The
        rollout pool keeps generating and the queue keeps its contents meanwhile: the queue's state is saved
        with the checkpoint but not restored, so no group is handed out twice or lost."""
        fleet, state = self.fleet, self.state
        self._collect_evaluation(wait=True)  # the new pool can stage only its own version: none held back
        self._close_sync()
        old, began = fleet.learner.num_ranks, time.time()
        self.telemetry.note(
            f"resizing the learner pool {old} -> {ranks} ranks at step {state.step}, version {state.version}"
        )
        folder = self._checkpoint(export=False)
        checkpointed = time.time()
        refused = fleet.reform_learner(ranks, folder, state.version)
        now = fleet.learner.num_ranks
        event = {
            "kind": "learner_resized" if refused is None else "learner_resize_refused",
            "worker": "learner",
            "from_ranks": old,
            "ranks": now,
            "wanted_ranks": ranks,
            "version": state.version,
            "requested_at": requested_at,
            "checkpoint_s": round(checkpointed - began, 3),
            "reform_s": round(time.time() - checkpointed, 3),
            "detail": refused,
        }
        fleet.event(**event)
        if refused is not None:
            fleet.refused_learner = (ranks, requested_at)
            self.telemetry.note(f"learner pool stays at {now} ranks: {refused}")
            return
        self.resized = event
        self.telemetry.note(
            f"learner pool re-formed with {now} ranks in {event['checkpoint_s'] + event['reform_s']:.1f} s "
            f"(checkpoint {event['checkpoint_s']:.1f} s); training goes on at version {state.version}"
        )

    def _first_step_after_resize(self) -> None:
        """Mark the first step the re-formed learner pool finished (`learner_scaling` in the summary)."""
        if self.resized is None:
            return
        resized, self.resized = self.resized, None
        self.fleet.event(kind="learner_first_step", worker="learner", ranks=resized["ranks"])
        ranks, step = resized["ranks"], self.state.step
        self.telemetry.note(f"first step on the re-formed learner pool ({ranks} ranks): step {step}")

    def _data_position(self) -> dict[str, Any] | None:
        """A Parquet stream's position (epoch, rows read, prompts dropped); None for the generated tasks."""
        return self.prompts.state_dict() if isinstance(self.prompts, ParquetPrompts) else None

    def _location(self, *parts: str) -> str | Path:
        """A place in the run folder the learner writes: a path, or a URI in an object store."""
        uri = self.cfg.run_uri()
        return join(uri, *parts) if is_remote(uri) else self.records.out.joinpath(*parts)

    def _latest_checkpoint(self) -> str | Path:
        """The newest complete checkpoint of this run folder: one cut short by a crash has no state file."""
        from asyncrl.learner.checkpoint import STATE_FILE, is_complete

        where = self._location("checkpoints")
        folders: list[str | Path]
        if isinstance(where, str):
            store = self.cfg.storage.store()
            names = [n for n in reversed(store.listdir(where)) if n.startswith("step-")]
            folders = [uri for uri in (join(where, n) for n in names) if is_complete(uri, store)]
        else:
            folders = [f for f in sorted(where.glob("step-*"), reverse=True) if (f / STATE_FILE).is_file()]
        if not folders:
            raise FileNotFoundError(f"checkpoint.resume_from=latest: no complete checkpoint under {where}")
        return folders[0]

    def _resume(self, where: str) -> None:
        state = self.state
        folder = self._latest_checkpoint() if where == "latest" else where if is_remote(where) else Path(where)
        restored = self.fleet.learner.load_checkpoint(folder)
        extra = restored.extra
        state.step, state.version = restored.step, restored.version
        state.samples_trained, state.tokens_trained = extra["samples_trained"], extra["tokens_trained"]
        self.fleet.queue.load_state_dict(extra["queue"])
        self.evaluation.best.load_state_dict(extra.get("best_eval"))  # checkpoints from before it have none
        # A Parquet stream resumes at its checkpointed position; the generated ones are deterministic: skip what
        # the checkpointed run already drew.
        if isinstance(self.prompts, ParquetPrompts) and extra.get("data"):
            self.prompts.load_state_dict(extra["data"])
        else:
            for _ in range(extra["prompts_drawn"]):
                next(self.prompts)
        state.prompts_drawn = extra["prompts_drawn"]
        # Engines start from the model folder; bring them to the checkpointed weights and version.
        sync = self.fleet.sync
        sync.finish(sync.start(state.version, in_flight=False))
