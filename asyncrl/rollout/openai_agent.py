"""An environment that runs a user's agent harness against the rollout worker's OpenAI-compatible endpoint.

The user writes the harness as they would for any OpenAI-compatible server:

    async def agent(client: openai.AsyncOpenAI, prompt: str, episode: AgentEpisode) -> float | tuple[float, dict]

and names it in the config (`rollout.openai_agent: package.module:agent`). For each request the worker runs it
with a client whose calls carry the episode id (header `X-Episode-Id`); the endpoint captures every call
token-exactly, and the trajectory the queue receives is that capture (`asyncrl.rollout.openai_capture`), scored
with the reward the harness returns. `info` may set `truncated` (bool: the harness cut the episode short) and
`tool_calls` (int: the tools it ran, for the evaluation's tool-call rate). A greedy rollout (the held-out
evaluation) is served at temperature 0 whatever the harness asks.

Failures: a harness that raises, or makes no model call, fails its trajectory `agent_error: ...` (kept out of
the advantages, like any infrastructure failure); one that runs past `timeout_s` is stopped and its captured
calls train as a `timeout` episode, truncated.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.lookup import load_plugin
from asyncrl.rollout.openai_server import EPISODE_HEADER, OpenAIServer
from asyncrl.types import Prompt, Request, Trajectory


@dataclass(frozen=True)
class AgentEpisode:
    """What the harness knows about its episode: the task (ground truth, extra info) and the served model name."""

    episode_id: str
    prompt: Prompt
    model: str


AgentFn = Callable[[Any, str, AgentEpisode], Awaitable[Any]]


def resolve_agent(path: str) -> AgentFn:
    """Import `module:function`; it must be an async function (the harness awaits the client)."""
    fn = load_plugin(path, "agent", form="package.module:function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {path!r} must name an async function `agent(client, prompt, episode)`")
    return fn


@dataclass(frozen=True)
class AgentOutcome:
    """How a harness run ended: its reward and truncation, or why it failed, or that it timed out."""

    reward: float = 0.0
    truncated: bool = False
    tool_calls: int = 0
    failure: str | None = None
    timed_out: bool = False


class OpenAIAgentEnv:
    """Runs `agent` once per request against `server` (the same worker's endpoint) and returns the trajectory.

    Plug-in point: `await env.rollout(request, worker_name)` replaces the worker's `engine.generate` + reward.
    """

    def __init__(self, agent: AgentFn, server: OpenAIServer, timeout_s: float) -> None:
        import openai

        self.agent = agent
        self.server = server
        self.timeout_s = timeout_s
        self.client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.api_key or "asyncrl", max_retries=0
        )

    async def rollout(self, request: Request, worker: str, greedy: bool = False) -> Trajectory:
        episode = AgentEpisode(request.request_id, request.prompt, self.server.model_name)
        client = self.client.with_options(default_headers={EPISODE_HEADER: episode.episode_id})
        if greedy:
            self.server.greedy_episodes.add(episode.episode_id)
        try:
            outcome = await self._run(client, episode)
        finally:
            self.server.greedy_episodes.discard(episode.episode_id)
        try:
            captured = await self.server.finish_episode(episode.episode_id)
        except KeyError:
            return _no_call(request, worker, outcome.failure or "agent_error: the agent made no model call")
        fields = dict(
            prompt_id=request.prompt.prompt_id,
            group_id=request.group_id,
            sample_index=request.sample_index,
            ground_truth=request.prompt.ground_truth,
            reward=outcome.reward,
            failure=outcome.failure,
            truncated=outcome.truncated or outcome.timed_out,
            tool_calls=outcome.tool_calls,
            worker=worker,
            attempt=request.attempt,
        )
        if outcome.timed_out:
            fields["finish_reason"] = "timeout"
        return captured.trajectory(**fields)

    async def _run(self, client: Any, episode: AgentEpisode) -> AgentOutcome:
        try:
            result = await asyncio.wait_for(self.agent(client, episode.prompt.text, episode), self.timeout_s)
        except TimeoutError:
            return AgentOutcome(timed_out=True)
        except Exception as e:  # the harness's own bug or an endpoint error it did not handle
            return AgentOutcome(failure=f"agent_error: {_described(e)}")
        reward, info = result if isinstance(result, tuple) else (result, {})
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return AgentOutcome(failure=f"agent_error: the agent returned reward {reward!r}, not a finite number")
        calls = info.get("tool_calls", 0)
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            return AgentOutcome(failure=f"agent_error: the agent returned tool_calls {calls!r}, not a count")
        return AgentOutcome(reward=float(reward), truncated=bool(info.get("truncated", False)), tool_calls=calls)


def _described(error: BaseException) -> str:
    """`Type: message`, then what raised it where the message hides it (the openai client's "Connection error."
    wraps the transport's own error as its cause)."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return text if cause is None else f"{text} (caused by {type(cause).__name__}: {cause})"


def _no_call(request: Request, worker: str, failure: str) -> Trajectory:
    """The trajectory of an episode without a model call: the prompt alone, failed."""
    empty = np.zeros(0, dtype=np.int32)
    return Trajectory(
        prompt_id=request.prompt.prompt_id,
        group_id=request.group_id,
        sample_index=request.sample_index,
        prompt_ids=np.asarray(request.prompt.prompt_ids, dtype=np.int32),
        response_ids=empty,
        rollout_logprobs=np.zeros(0, dtype=np.float32),
        loss_mask=np.zeros(0, dtype=np.int8),
        versions=empty,
        finish_reason="error",
        ground_truth=request.prompt.ground_truth,
        failure=failure,
        worker=worker,
        attempt=request.attempt,
    )
