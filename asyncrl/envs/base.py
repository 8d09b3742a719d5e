"""The environment protocol: what a rollout worker drives to turn one prompt into one (multi-turn) episode.

An environment is built once per episode with an `EnvContext` (the tool executor, the reward and timeouts)
plus the config's `env.kwargs`. The worker calls `reset(prompt)` once, then alternates a model turn with
`step(action_text, finish_reason=...)` until a step says `done` or a limit (`env.max_turns`,
`env.max_total_tokens`, `env.episode_timeout_s`) cuts the episode. A model turn ends at end-of-sequence or at
one of the environment's `stop` strings (the close marker of a tool call); the environment sees the turn's
text, never its tokens: the worker keeps the token sequence exact (asyncrl/rollout/episode_runner.py).

Environments raise `ToolInfraError` (the tool could not run at all: the episode fails `failed:<reason>`, kept out
of the advantages) or `RewardError` (the reward could not be computed); a tool that merely errs is the model's
problem and comes back as an observation.

Built-ins are registered by name in `BUILTIN_ENVS`; users name their own class `package.module:Class`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.envs.tools.base import InProcessTools, ToolExecutor
from asyncrl.lookup import load_plugin
from asyncrl.types import Prompt


@dataclass(frozen=True)
class Observation:
    """Text the environment appends to the episode; the worker tokenizes it without special tokens."""

    text: str = ""


@dataclass(frozen=True)
class StepInfo:
    """What happened inside one step, for counters and finish reasons."""

    tool: str | None = None
    """The tool the action called (None: the action was not a tool call)."""
    tool_error: str | None = None
    """The tool's error reason when the call failed (`timeout`, `error`, ...)."""


@dataclass(frozen=True)
class StepResult:
    observation: Observation | None
    """Appended before the next model turn (None or empty: nothing is appended)."""
    reward: float = 0.0
    """Reward of this step; the episode's reward is the sum over its steps."""
    done: bool = False
    """The episode is over (the model answered, or gave up): terminal, no bootstrap."""
    info: StepInfo = field(default_factory=StepInfo)


@dataclass(frozen=True)
class EnvContext:
    """What every environment gets when it is built (the same for every episode of a worker)."""

    tools: ToolExecutor = field(default_factory=InProcessTools)
    reward: str = "exact_match"
    """`env.reward`: a built-in reward name or `module:function`, run through `tools.reward`."""
    reward_timeout_s: float = 10.0
    tool_timeout_s: float = 5.0


@runtime_checkable
class Env(Protocol):
    stop: tuple[str, ...]
    """Strings that end a model turn (kept in the turn's tokens); empty: a turn ends only at end-of-sequence."""

    async def reset(self, prompt: Prompt) -> Observation: ...

    async def step(self, action_text: str, *, finish_reason: str = "stop") -> StepResult: ...


BUILTIN_ENVS: dict[str, str] = {
    "single_turn": "asyncrl.envs.single_turn:SingleTurnEnv",
    "calc": "asyncrl.envs.calc:CalcEnv",
    "word_problems": "asyncrl.envs.calc:WordProblemEnv",
}


@functools.cache
def resolve_env(name: str) -> type:
    """The environment class of a built-in name or an import path `package.module:Class`; raises ValueError
    naming what is wrong (unknown name, import failure, not a class, missing protocol methods). Resolved once
    per process: `make_env` runs once per episode (an import and four checks each time were ~4% of a W1 rollout
    worker's CPU)."""
    cls = load_plugin(name, "environment", BUILTIN_ENVS, form="package.module:Class")
    if not inspect.isclass(cls):
        raise ValueError(f"environment {name!r} is not a class")
    for method in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise ValueError(f"environment {name!r} lacks `async def {method}` (see asyncrl.envs.base.Env)")
    return cls


def make_env(name: str, kwargs: dict[str, Any], context: EnvContext) -> Env:
    """A fresh environment for one episode; raises ValueError when it does not satisfy the protocol."""
    try:
        env = resolve_env(name)(context, **kwargs)
    except TypeError as e:
        raise ValueError(f"environment {name!r} rejected env.kwargs {kwargs}: {e}") from None
    stop = getattr(env, "stop", None)
    if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"environment {name!r}: `stop` must be a tuple of non-empty strings (got {stop!r})")
    return env


def is_multi_turn(name: str) -> bool:
    """Every environment but `single_turn` is evaluated by running episodes (tools and all)."""
    return name != "single_turn"
