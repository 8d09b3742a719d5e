"""The rollout pool's calls spread across its workers: evaluation shared out over the serving engines, the parity
probe's scoring, and the probes and counters the controller and tests read (pids, versions, endpoints, stats)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from asyncrl.cluster.calls import named_get
from asyncrl.config import RolloutConfig
from asyncrl.rollout.engine import EvalResult
from asyncrl.rollout.membership import Heartbeat, wait_in_turns
from asyncrl.rollout.worker import EpisodeScore, WorkerSpec
from asyncrl.types import Prompt

CONTROL_TIMEOUT_S = 30.0  # stop / stats / health calls


class EvaluationTimeout(RuntimeError):
    """An evaluation call was not answered in time (the message names the workers still running it)."""


@dataclass(frozen=True)
class SpreadCall:
    """A call spread over the serving workers and not yet collected (`WorkerCalls.finish_spread`)."""

    method: str
    prompts: list[Any]
    args: tuple[Any, ...]
    timeout_s: float
    deadline: float
    """`time.monotonic()` by which every worker must have answered."""
    calls: dict[Any, str]
    """Each worker's answer (a Ray object ref) -> the worker's name."""


class WorkerCalls(ABC):
    """Calls to the pool's workers (`_workers`: name -> actor handle) that `RolloutPool` answers; `serving` is
    the pool's list of serving workers after its upkeep, `_replace_hung` its heartbeat's kill-and-replace."""

    rollout: RolloutConfig
    spec: WorkerSpec
    _workers: dict[str, Any]
    _last_stats: dict[str, dict[str, Any]]
    heartbeat: Heartbeat

    @abstractmethod
    def serving(self) -> list[str]: ...

    @abstractmethod
    def _replace_hung(self) -> list[str]: ...

    def pids(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, int]:
        """Process id of each serving worker (fault injection kills real processes)."""
        names = list(self._workers)
        answers = named_get(
            [self._workers[n].ready.remote() for n in names], timeout_s, f"rollout workers {', '.join(names)}: ready"
        )
        return dict(zip(names, (r["pid"] for r in answers), strict=True))

    def openai_urls(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, str]:
        """Base URL of each serving worker's OpenAI-compatible endpoint (`rollout.openai_port` != 0); a client's
        `base_url` is the URL + `/v1`."""
        names = self.serving()
        answers = named_get(
            [self._workers[n].ready.remote() for n in names], timeout_s, f"rollout workers {', '.join(names)}: ready"
        )
        return {n: a["openai_url"] for n, a in zip(names, answers, strict=True) if a["openai_url"] is not None}

    def versions(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, int]:
        names = list(self._workers)
        return dict(
            zip(
                names,
                named_get(
                    [self._workers[n].version.remote() for n in names],
                    timeout_s,
                    f"rollout workers {', '.join(names)}: version",
                ),
                strict=True,
            )
        )

    def score(
        self, token_ids: Sequence[int], prompt_len: int, name: str | None = None, processed: bool = False
    ) -> np.ndarray:
        """Engine log-probs of token_ids[prompt_len:] (the parity probe), on `name` or the first serving worker:
        raw, or (`processed`) under the run's temperature, top-k and top-p."""
        name = name or self.serving()[0]
        return named_get(
            self._workers[name].score.remote(list(token_ids), prompt_len, processed),
            CONTROL_TIMEOUT_S,
            f"rollout worker {name}: score",
        )

    def evaluate(
        self,
        prompts: Sequence[Prompt | Sequence[int]],
        max_tokens: int | None = None,
        temperature: float = 0.0,
        samples: int = 1,
    ) -> list[EvalResult]:
        """`samples` completions per prompt at `temperature` (0 = greedy), in prompt order, spread over the
        serving workers. A worker that dies meanwhile is replaced and its share evaluated again on the others."""
        return self._spread(
            "evaluate",
            prompts,
            max_tokens,
            temperature,
            samples,
            timeout_s=self.rollout.request_timeout_s + CONTROL_TIMEOUT_S,
        )

    def evaluate_episodes(self, prompts: Sequence[Prompt], max_tokens: int | None = None) -> list[EpisodeScore]:
        """Greedy episodes of the run's environment (multi-turn, tools and all), like `evaluate`."""
        return self._spread(
            "evaluate_episodes", prompts, max_tokens, timeout_s=self.spec.env.episode_timeout_s + CONTROL_TIMEOUT_S
        )

    def start_evaluate(
        self, prompts: Sequence[Prompt], max_tokens: int | None = None, temperature: float = 0.0, samples: int = 1
    ) -> SpreadCall:
        """`evaluate`, dispatched without waiting: `finish_spread` collects it (`spread_done` says whether it
        may without waiting). The engines run it beside the rollouts, sharing their slots."""
        timeout_s = self.rollout.request_timeout_s + CONTROL_TIMEOUT_S
        return self._dispatch("evaluate", prompts, (max_tokens, temperature, samples), timeout_s)

    def start_evaluate_episodes(self, prompts: Sequence[Prompt], max_tokens: int | None = None) -> SpreadCall:
        """`evaluate_episodes`, dispatched without waiting, like `start_evaluate`."""
        timeout_s = self.spec.env.episode_timeout_s + CONTROL_TIMEOUT_S
        return self._dispatch("evaluate_episodes", prompts, (max_tokens,), timeout_s)

    def spread_done(self, call: SpreadCall) -> bool:
        """Whether every worker answered `call` (collecting it then does not wait)."""
        return not ray.wait(list(call.calls), num_returns=len(call.calls), timeout=0)[1]

    def finish_spread(self, call: SpreadCall) -> list[Any]:
        """The answers of a dispatched call, in prompt order, waiting at most what is left of its bound; a worker
        that died meanwhile is replaced and the whole call run again (`_spread`)."""
        try:
            return self._collect(call, max(0.0, call.deadline - time.monotonic()))
        except RayActorError:
            time.sleep(1.0)  # then `serving()` notices the dead worker and replaces it
            return self._spread(call.method, call.prompts, *call.args, timeout_s=call.timeout_s)

    def _spread(self, method: str, prompts: Sequence[Any], *args: Any, timeout_s: float) -> list[Any]:
        """`method` on every serving worker, each with its share of `prompts`, all at once: a worker runs its
        share concurrently, so the whole call is bounded by one request's (or episode's) bound, `timeout_s`."""
        for _ in range(3):
            try:
                return self._collect(self._dispatch(method, prompts, args, timeout_s), timeout_s)
            except RayActorError:
                time.sleep(1.0)  # then `serving()` notices the dead worker and replaces it
        raise RuntimeError("evaluation failed three times: rollout workers kept dying")

    def _dispatch(self, method: str, prompts: Sequence[Any], args: tuple[Any, ...], timeout_s: float) -> SpreadCall:
        names = self.serving()
        per_worker = -(-len(prompts) // len(names))
        chunks = [list(prompts[i : i + per_worker]) for i in range(0, len(prompts), per_worker)]
        calls = {
            getattr(self._workers[n], method).remote(c, *args): n for n, c in zip(names, chunks, strict=False)
        }  # fewer chunks than workers: some idle
        return SpreadCall(method, list(prompts), args, timeout_s, time.monotonic() + timeout_s, calls)

    def _collect(self, call: SpreadCall, timeout_s: float) -> list[Any]:
        try:
            return [item for part in self._get_all(list(call.calls), timeout_s) for item in part]
        except GetTimeoutError:
            late = [call.calls[ref] for ref in ray.wait(list(call.calls), num_returns=len(call.calls), timeout=0)[1]]
            raise EvaluationTimeout(
                f"{call.method} of {len(call.prompts)} prompts: no answer within {call.timeout_s:.0f}s "
                f"from {', '.join(late)}"
            ) from None

    def _get_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """`ray.get(refs, timeout=timeout_s)`, waited in turns that kill hung workers: a hung worker's call then
        fails with its death (`RayActorError`) instead of running into the timeout."""

        def replace_hung(waiting: list[Any]) -> list[Any]:
            self._replace_hung()
            return waiting

        if wait_in_turns(refs, timeout_s, replace_hung)[1]:
            raise GetTimeoutError(f"no answer within {timeout_s}s")
        return ray.get(refs)

    def stats(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """Per serving worker, its counters (tokens generated, requests done, busy/idle seconds); a worker that
        does not answer within `timeout_s` (busy loading weights, say) keeps its last answer, so the run's
        totals never step back; so does one that leaves its heartbeat unanswered (hung, until the heartbeat
        replaces it). Workers that died or were removed are in `retired`."""
        calls = {h.stats.remote(): name for name, h in self._workers.items() if not self.heartbeat.silent(name)}
        done, _ = wait_in_turns(
            list(calls), timeout_s, lambda waiting: [ref for ref in waiting if not self.heartbeat.silent(calls[ref])]
        )
        for ref in done:
            try:
                self._last_stats[calls[ref]] = ray.get(ref)
            except RayActorError:
                continue
        return {name: self._last_stats[name] for name in self._workers if name in self._last_stats}
