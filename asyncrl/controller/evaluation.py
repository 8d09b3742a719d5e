"""Held-out evaluation of the policy the engines serve, the best policy kept, and the engine-learner parity probe
(invariant 4). An evaluation starts (`Evaluation.start`) once every engine serves the run's version (no sync in
flight); with `eval.blocking: false` the loop collects it (`finish`) steps later, and publishes no weights while it
runs, so that it is pinned to the version it started with."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.controller.best import BestPolicy
from asyncrl.controller.fleet import Fleet
from asyncrl.controller.records import RunState
from asyncrl.remote import is_remote, join
from asyncrl.telemetry.sinks import Telemetry

if TYPE_CHECKING:
    from asyncrl.rollout.engine import EvalResult
    from asyncrl.rollout.pool import SpreadCall
    from asyncrl.rollout.worker import EpisodeScore
    from asyncrl.types import Prompt


@dataclass
class PendingEvaluation:
    """An evaluation dispatched to the engines and not yet scored."""

    call: SpreadCall
    record: dict[str, Any]
    """What it evaluates, taken when it started: `version`, `step`, `samples_trained`."""
    began: float
    """`time.perf_counter()` when it started."""
    wall_s_excl_eval: float
    """Seconds of the run when it started, less those the loop had waited for evaluations."""
    export: Callable[[Path], None] | None
    """Writes the evaluated policy into a folder (`BestPolicy.offer`); None when it can no longer be written."""
    waited_s: float = 0.0
    """Seconds the loop spent on it (waiting for it, exporting its candidate policy)."""
    publishes_deferred: int = 0
    """Weight publications the loop held back while it ran."""
    reran: bool = False


class Evaluation:
    """The run's evaluations (`evals`, one record each), on `eval_set` (set by the controller's start); at most one
    in flight (`pending`)."""

    def __init__(self, cfg: Config, out: Path, fleet: Fleet, state: RunState, telemetry: Telemetry) -> None:
        self.cfg, self.fleet, self.state, self.telemetry = cfg, fleet, state, telemetry
        self.eval_set: list[Prompt] = []
        self.probe: tuple[list[int], int] = ([], 0)
        """The parity probe's fixed sequence (a held-out prompt and its answer) and its prompt's length."""
        self.evals: list[dict[str, Any]] = []
        self.pending: PendingEvaluation | None = None
        self.waited_s = 0.0
        """Seconds the loop spent on evaluations (waiting for them; with `eval.blocking` their whole time)."""
        self.straddled = 0
        """Evaluations recorded with `straddled: true` (some request ran under a newer version)."""
        self.dropped = 0
        """Evaluations dropped in flight (a stop)."""
        self.publishes_deferred = 0
        """Weight publications held back while an evaluation ran (`defer_publish`)."""
        uri = cfg.run_uri()
        remote = (uri, cfg.storage.store()) if is_remote(uri) else None
        self.best = BestPolicy(out, cfg.checkpoint.export_best, remote)
        self.candidate: str | Path = join(uri, "best_model.candidate") if remote else out / "best_model.candidate"
        """Where a non-blocking evaluation's policy is exported when it starts (`checkpoint.export_best`)."""

    def run(self, start: float) -> None:
        """One held-out evaluation, waited for (`start`, then `finish`): the loop spends all its time on it."""
        self.start(start, waited=True)
        self.finish(start, whole=True)

    def start(self, start: float, waited: bool = False) -> None:
        """Dispatch a held-out evaluation of the version the engines serve (the run's). Single-turn tasks:
        `eval.samples` completions per prompt at `eval.temperature` (greedy by default); multi-turn environments:
        one greedy episode per prompt, tools and all. With `checkpoint.export_best`, unless it is `waited` for
        (`run`, `eval.blocking`: then the best is exported when it is in), the learner's policy is exported now as
        the candidate (`best_model.candidate`), while the learner still holds the evaluated weights; an evaluation
        started after the learner trained past its version has none."""
        if not self.eval_set:
            return
        if self.pending is not None:
            raise RuntimeError("an evaluation is in flight already: finish it first")
        state, began = self.state, time.perf_counter()
        record = {"version": state.version, "step": state.step, "samples_trained": state.samples_trained}
        pending = PendingEvaluation(self._dispatch(), record, began, began - start - self.waited_s, None)
        if waited or self.cfg.eval.blocking:
            pending.export = self.fleet.learner.export_hf if state.learner_at_version else None
        elif self.cfg.checkpoint.export_best and state.learner_at_version:
            self._remove_candidate()
            self.fleet.learner.export_hf(self.candidate)
            pending.export = self._move_candidate
            pending.waited_s = time.perf_counter() - began
        self.pending = pending

    def ready(self) -> bool:
        """Whether an evaluation is in flight and every engine has answered it."""
        return self.pending is not None and self.fleet.rollout.spread_done(self.pending.call)

    def finish(self, start: float, whole: bool = False) -> dict[str, Any] | None:
        """Wait for the evaluation in flight (if any), score it, record it (`evals`, telemetry) and offer it as the
        best (with `checkpoint.export_best` exported: `controller.best`); -> its record. The engines report the
        versions every request ran under: one that ran under a newer version makes it `straddled` (with
        `eval.blocking` it is run once more first). `whole`: the loop waited since it started (`run`)."""
        pending = self.pending
        if pending is None:
            return None
        waiting = time.perf_counter()
        fields = self._scores(pending)
        record = pending.record | fields
        exporting = time.perf_counter()
        if self.best.offer(record, pending.export) and self.best.record is not None and self.best.record["exported"]:
            record["best_export_s"] = round(time.perf_counter() - exporting, 2)
        self._remove_candidate()
        self.pending, ended = None, time.perf_counter()
        pending.waited_s = ended - pending.began if whole else pending.waited_s + ended - waiting
        record |= {
            "wall_s": round(ended - start, 2),
            "wall_s_excl_eval": round(pending.wall_s_excl_eval, 2),
            "eval_s": round(ended - pending.began, 2),
            "eval_wait_s": round(pending.waited_s, 2),
            "blocking": whole,
            "publishes_deferred": pending.publishes_deferred,
            "recorded_at_step": self.state.step,
        }
        self.waited_s += pending.waited_s
        self.straddled += bool(record.get("straddled"))
        self.evals.append(record)
        self.telemetry.eval(record)
        return record

    def defer_publish(self) -> None:
        """Count a weight publication the loop holds back because this evaluation is in flight."""
        if self.pending is not None:
            self.pending.publishes_deferred += 1
            self.publishes_deferred += 1

    def drop(self) -> None:
        """Leave the evaluation in flight unrecorded (the run stops), saying so."""
        if self.pending is not None:
            self.telemetry.note(f"evaluation of version {self.pending.record['version']} dropped: the run stops")
            self.pending, self.dropped = None, self.dropped + 1
            self._remove_candidate()

    def _move_candidate(self, folder: str | Path) -> None:
        if self.best.remote is not None:  # the learner exported the candidate to the object store (`BestPolicy`)
            store = self.best.remote[1]
            store.remove(str(folder))
            store.move(str(self.candidate), str(folder))
        else:
            Path(self.candidate).rename(folder)

    def _remove_candidate(self) -> None:
        if self.best.remote is not None:
            self.best.remote[1].remove(str(self.candidate))
        else:
            shutil.rmtree(self.candidate, ignore_errors=True)

    def _dispatch(self) -> SpreadCall:
        from asyncrl.envs.base import is_multi_turn

        rollout, cfg = self.fleet.rollout, self.cfg
        if is_multi_turn(cfg.env.name) or cfg.rollout.openai_agent:  # episodes of the env or of the harness
            return rollout.start_evaluate_episodes(self.eval_set, max_tokens=cfg.rollout.max_tokens)
        return rollout.start_evaluate(
            self.eval_set, max_tokens=cfg.rollout.max_tokens, temperature=cfg.eval.temperature, samples=cfg.eval.samples
        )

    def parity(self) -> float:
        """Max |engine - learner| log-prob on the probe sequence (invariant 4): under the raw distribution and,
        when the run samples from a processed one (temperature, top-k, top-p), under that too."""
        from asyncrl.algo.sampling import RAW, SamplingDistribution, logprob_gap

        (ids, plen), rollout, learner = self.probe, self.fleet.rollout, self.fleet.learner
        gap = logprob_gap(rollout.score(ids, plen).tolist(), learner.score(ids, plen, RAW).tolist())
        r = self.cfg.rollout
        if SamplingDistribution(r.temperature, r.top_p, r.top_k) != RAW:
            engine = rollout.score(ids, plen, processed=True).tolist()
            gap = max(gap, logprob_gap(engine, learner.score(ids, plen).tolist()))
        return gap

    def _scores(self, pending: PendingEvaluation) -> dict[str, Any]:
        """The scores of the evaluation in flight, collected from the engines."""
        from asyncrl.envs.base import is_multi_turn

        rollout = self.fleet.rollout
        if is_multi_turn(self.cfg.env.name) or self.cfg.rollout.openai_agent:
            return self._episodes(rollout.finish_spread(pending.call))
        version = pending.record["version"]
        outputs = rollout.finish_spread(pending.call)
        served = sorted({v for o in outputs for v in o.versions})
        if served != [version] and self.cfg.eval.blocking and not pending.reran:
            pending.call, pending.reran = self._dispatch(), True  # the engines serve the run's version again
            return self._scores(pending)
        if served != [version]:
            self.telemetry.note(f"evaluation of version {version} straddled versions {served}: recorded as such")
        return self._answers(outputs) | {"served_versions": served, "straddled": served != [version]}

    def _answers(self, outputs: Sequence[EvalResult]) -> dict[str, Any]:
        """Mean@k and pass@k of `eval.samples` completions per prompt at `eval.temperature`."""
        from asyncrl.algo.evaluation import score_samples

        scores = score_samples(self._rewards(outputs))
        return {
            "accuracy": scores.mean_at_k,
            "temperature": self.cfg.eval.temperature,
            "samples": self.cfg.eval.samples,
            "mean_at_k": scores.mean_at_k,
            "pass_at_k": {str(k): v for k, v in scores.pass_at.items()},
        }

    @staticmethod
    def _episodes(scores: Sequence[EpisodeScore]) -> dict[str, Any]:
        """Greedy held-out episodes (tools and all): success, the tool-call rate (episodes that called a tool at
        least once), mean turns and failed episodes for the eval record."""
        n = max(1, len(scores))
        return {
            "accuracy": sum(s.reward for s in scores) / n,
            "tool_call_rate": sum(s.tool_calls > 0 for s in scores) / n,
            "turns_mean": sum(s.num_turns for s in scores) / n,
            "episodes_failed": sum(s.failure is not None for s in scores),
        }

    def _rewards(self, outputs: Sequence[EvalResult]) -> list[list[float]]:
        """rewards[prompt][sample] of `rollout.evaluate`'s results on the held-out set."""
        answers = [
            (p, text, fin)
            for p, out in zip(self.eval_set, outputs, strict=True)
            for text, fin in zip(out.texts, out.finish_reasons, strict=True)
        ]
        flat = iter(self._score_answers(answers))
        return [[next(flat) for _ in out.texts] for out in outputs]

    def _score_answers(self, answers: list[tuple[Prompt, str, str]]) -> list[float]:
        """Rewards of (prompt, text, finish reason) answers: in the sandboxed tool workers when the run has them
        (a user reward never runs in the driver), else here. An answer whose reward fails scores 0."""
        from asyncrl.envs.rewards import resolve_reward
        from asyncrl.envs.tools.base import RewardError, ToolInfraError

        tools = self.fleet.tools
        if tools is None:
            reward = resolve_reward(self.cfg.env.reward)
            return [
                float(reward(text, p.ground_truth, finish_reason=fin, extra_info=p.extra_info))
                for p, text, fin in answers
            ]
        client, env = tools.client(), self.cfg.env

        async def score(prompt: Prompt, text: str, finish: str) -> float:
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
            return list(await asyncio.gather(*(score(p, text, fin) for p, text, fin in answers)))

        return asyncio.run(score_all())
