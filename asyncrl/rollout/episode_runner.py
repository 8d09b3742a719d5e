"""`EpisodeRunner`: drives one environment episode on an engine and returns it as one `Trajectory`.

Turns alternate: the engine samples a model turn from the exact token context so far (`EpisodeBuilder.
context_ids`: the prompt, every sampled token as sampled and every observation's tokens; nothing is re-rendered
or re-tokenized), the environment steps on the turn's text, and its observation is tokenized without special
tokens and appended. With `chat` (`ChatTurns`, the model's chat template) the observation is first written as a
chat message — role `tool` after a tool call, else `user` — closing the model's turn and opening the next one,
so an episode on a chat model keeps its chat format; the sampled tokens are never re-tokenized either way. A turn
ends at end-of-sequence, at one of the environment's stop strings, or at
`rollout.max_tokens` (per turn).

How an episode ends (`finish_reason`, and `truncated` when a limit cut it, so GAE bootstraps from V(s_T)):
- the environment says done: `stop` (terminal), `tool_error` when a failed tool call ended it (terminal), or
  the last turn's `length` (truncated);
- `max_turns`, `context` (`env.max_total_tokens`), `timeout` (`env.episode_timeout_s`): truncated;
- a failed turn (engine error, request timeout, stale abort) fails the episode with the turn's `failure`; a
  `ToolInfraError` fails it `"<reason>: ..."` (the queue's `failed:<reason>`), a `RewardError`
  `"reward_error: ..."`. Failed episodes are kept out of the advantages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.envs.base import Env, StepResult
from asyncrl.envs.episode import ChatTurns, EpisodeBuilder
from asyncrl.envs.tools.base import RewardError, ToolInfraError
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.types import Request, Trajectory

TRUNCATING = ("length", "max_turns", "context", "timeout")
"""Finish reasons of an episode cut by a limit rather than ended by the model or the environment."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 1
    max_total_tokens: int = 512
    """Prompt plus response tokens (model turns and observations)."""
    timeout_s: float = 600.0


@dataclass
class _Episode:
    """The mutable state of one running episode."""

    builder: EpisodeBuilder
    deadline: float
    reward: float = 0.0
    tool_calls: int = 0
    last: Trajectory | None = None
    """The last model turn as the engine returned it (timestamps, worker, attempt)."""


class EpisodeRunner:
    """`engine`: `generate(request, sampling)`, `encode(text)`, `version` (an `Engine`); `make_env()`: a fresh
    environment per episode; `chat`: how observations are written between model turns (None: as they are)."""

    def __init__(self, engine, make_env: Callable[[], Env], limits: EpisodeLimits, chat: ChatTurns | None = None):
        self.engine = engine
        self.make_env = make_env
        self.limits = limits
        self.chat = chat

    async def run(self, request: Request, sampling: SamplingSpec) -> Trajectory:
        env = self.make_env()
        started = time.time()
        observation = await env.reset(request.prompt)
        prompt_ids = list(request.prompt.prompt_ids) + self._encode(observation.text)
        episode = _Episode(EpisodeBuilder(prompt_ids, self.engine.version), time.monotonic() + self.limits.timeout_s)
        finish, failure = await self._turns(episode, env, request, _replaced(sampling, stop=env.stop))
        return self._build(episode, request, finish, failure, started)

    async def _turns(self, ep: _Episode, env: Env, request: Request, sampling: SamplingSpec) -> tuple[str, str | None]:
        """Model turns and environment steps until the episode ends; -> (finish_reason, failure)."""
        for _ in range(self.limits.max_turns):
            room = self.limits.max_total_tokens - len(ep.builder.context_ids)
            remaining = ep.deadline - time.monotonic()
            if room < 1 or remaining <= 0:
                return ("context" if room < 1 else "timeout"), None
            turn_sampling = self._turn_sampling(sampling, room, remaining)
            turn = await self.engine.generate(self._turn_request(request, ep), turn_sampling)
            ep.last = turn
            ep.builder.add_model_turn(turn.response_ids, turn.rollout_logprobs, turn.versions)
            if turn.failed:
                return self._failed_turn(turn, turn_sampling, sampling)
            try:
                result = await env.step(turn.response_text, finish_reason=turn.finish_reason)
            except ToolInfraError as e:
                return "error", str(e)  # "<reason>: <detail>": the queue labels it failed:<reason>
            except RewardError as e:
                return "error", f"reward_error: {e}"
            ended = self._after_step(ep, result, turn, room)
            if ended is not None:
                return ended, None
        return "max_turns", None

    def _after_step(self, ep: _Episode, result: StepResult, turn: Trajectory, room: int) -> str | None:
        """Account the step and append its observation; -> the finish reason if the episode ended here."""
        ep.reward += result.reward
        ep.tool_calls += result.info.tool is not None
        if result.done:
            if result.info.tool_error is not None:
                return "tool_error"
            return (
                "context" if turn.finish_reason == "length" and len(turn.response_ids) >= room else turn.finish_reason
            )
        ids = self._encode(self._observation_text(result, turn))
        if len(ep.builder.context_ids) + len(ids) > self.limits.max_total_tokens:
            return "context"
        ep.builder.add_observation(ids)
        return None

    def _observation_text(self, result: StepResult, turn: Trajectory) -> str:
        text = result.observation.text if result.observation else ""
        if self.chat is None or not text:
            return text
        role = "tool" if result.info.tool is not None else "user"
        last = int(turn.response_ids[-1]) if len(turn.response_ids) else None
        return self.chat.observation_text(text, role, last)

    def _failed_turn(
        self, turn: Trajectory, turn_sampling: SamplingSpec, sampling: SamplingSpec
    ) -> tuple[str, str | None]:
        """A turn the engine cut short: the episode's wall-time limit (truncated, not failed) or a failure."""
        episode_clock = sampling.timeout_s is None or (turn_sampling.timeout_s or 0) < sampling.timeout_s
        if (turn.failure or "").startswith("timeout") and episode_clock:
            return "timeout", None
        return turn.finish_reason, turn.failure

    @staticmethod
    def _turn_sampling(sampling: SamplingSpec, room: int, remaining: float) -> SamplingSpec:
        timeout_s = remaining if sampling.timeout_s is None else min(sampling.timeout_s, remaining)
        return _replaced(sampling, max_tokens=min(sampling.max_tokens, room), timeout_s=timeout_s)

    @staticmethod
    def _turn_request(request: Request, ep: _Episode) -> Request:
        if not ep.builder.ids:
            return request
        prompt = dataclasses.replace(request.prompt, prompt_ids=ep.builder.context_ids)
        return dataclasses.replace(request, prompt=prompt, context_min_version=ep.builder.oldest_model_version)

    def _encode(self, text: str) -> list[int]:
        return self.engine.encode(text) if text else []

    def _build(self, ep: _Episode, request: Request, finish: str, failure: str | None, started: float) -> Trajectory:
        last = ep.last
        return ep.builder.build(
            prompt_id=request.prompt.prompt_id,
            group_id=request.group_id,
            sample_index=request.sample_index,
            finish_reason=finish,
            ground_truth=request.prompt.ground_truth,
            reward=ep.reward if failure is None else 0.0,
            failure=failure,
            worker=last.worker if last else "",
            attempt=request.attempt,
            submitted_at=last.submitted_at if last and ep.builder.num_turns == 1 else started,
            finished_at=last.finished_at if last else time.time(),
            response_text=self.engine.decode(ep.builder.ids)
            if ep.builder.num_turns > 1
            else (last.response_text if last else ""),
            truncated=finish in TRUNCATING and failure is None,
            tool_calls=ep.tool_calls,
        )


def _replaced(spec: SamplingSpec, **changes) -> SamplingSpec:
    """`spec` itself when `changes` change nothing (a single-turn episode samples with the worker's own spec)."""
    if all(getattr(spec, k) == v for k, v in changes.items()):
        return spec
    return dataclasses.replace(spec, **changes)
