"""Held-out evaluation of the policy the engines serve, the best policy kept, and the engine-learner parity probe
(invariant 4). The caller first makes sure every engine serves the run's version (no sync in flight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.controller.best import BestPolicy
from asyncrl.controller.fleet import Fleet
from asyncrl.controller.records import RunState
from asyncrl.remote import is_remote
from asyncrl.telemetry.sinks import Telemetry

if TYPE_CHECKING:
    from asyncrl.rollout.engine import EvalResult
    from asyncrl.types import Prompt


class Evaluation:
    """The run's evaluations (`evals`, one record each), on `eval_set` (set by the controller's start)."""

    def __init__(self, cfg: Config, out: Path, fleet: Fleet, state: RunState, telemetry: Telemetry) -> None:
        self.cfg, self.fleet, self.state, self.telemetry = cfg, fleet, state, telemetry
        self.eval_set: list[Prompt] = []
        self.probe: tuple[list[int], int] = ([], 0)
        """The parity probe's fixed sequence (a held-out prompt and its answer) and its prompt's length."""
        self.evals: list[dict[str, Any]] = []
        self.eval_s = 0.0
        """Seconds spent in held-out evaluations (the loop waits for them)."""
        uri = cfg.run_uri()
        remote = (uri, cfg.storage.store()) if is_remote(uri) else None
        self.best = BestPolicy(out, cfg.checkpoint.export_best, remote)

    def run(self, start: float) -> None:
        """Held-out evaluation of the policy the engines serve. Single-turn tasks: `eval.samples` completions per
        prompt at `eval.temperature` (greedy by default); the engines report the versions every request ran under,
        and an evaluation that straddled a version change is run once more (then recorded with `straddled: true`).
        Multi-turn environments: one greedy episode per prompt, tools and all. A new best is recorded (and with
        `checkpoint.export_best` exported: `controller.best`), its seconds counted with the evaluation's."""
        if not self.eval_set:
            return
        from asyncrl.envs.base import is_multi_turn

        state = self.state
        began = time.perf_counter()
        fields = self._episodes() if is_multi_turn(self.cfg.env.name) else self._answers()
        record = {"version": state.version, "step": state.step, "samples_trained": state.samples_trained, **fields}
        exporting = time.perf_counter()
        export = self.fleet.learner.export_hf if state.learner_at_version else None
        if self.best.offer(record, export) and self.best.record is not None and self.best.record["exported"]:
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

    def _answers(self) -> dict[str, Any]:
        """`eval.samples` completions per prompt at `eval.temperature`, run once more if it straddled a version."""
        from asyncrl.algo.evaluation import score_samples

        version = self.state.version
        for _ in range(2):
            outputs = self.fleet.rollout.evaluate(
                self.eval_set,
                max_tokens=self.cfg.rollout.max_tokens,
                temperature=self.cfg.eval.temperature,
                samples=self.cfg.eval.samples,
            )
            served = sorted({v for o in outputs for v in o.versions})
            if served == [version]:
                break
        scores = score_samples(self._rewards(outputs))
        return {
            "accuracy": scores.mean_at_k,
            "temperature": self.cfg.eval.temperature,
            "samples": self.cfg.eval.samples,
            "mean_at_k": scores.mean_at_k,
            "pass_at_k": {str(k): v for k, v in scores.pass_at.items()},
            "served_versions": served,
            "straddled": served != [version],
        }

    def _episodes(self) -> dict[str, Any]:
        """Greedy held-out episodes (tools and all): success, the tool-call rate (episodes that called a tool at
        least once), mean turns and failed episodes for the eval record."""
        scores = self.fleet.rollout.evaluate_episodes(self.eval_set, max_tokens=self.cfg.rollout.max_tokens)
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
