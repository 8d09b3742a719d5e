"""The tool contract: what an environment asks for (`ToolCall`), what comes back (`ToolResult`), and who runs it
(`ToolExecutor`).

Two kinds of failure are kept apart, because they mean different things to the learner:
- a tool that errs or times out is the *model's* problem: it comes back as a `ToolResult` with `ok=False` and an
  `error` reason, the environment shows it to the model as an observation, and the episode goes on;
- an executor that cannot run the tool at all (its worker died, the sandbox could not start) is an
  *infrastructure* problem: it raises `ToolInfraError`, the episode ends `failed:<reason>` and is kept out of the
  advantages (never scored 0 as if the model had failed).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncrl.envs.tools.calculator import calculate


@dataclass(frozen=True)
class ToolCall:
    name: str
    """The tool's registered name (`calculator`, `python`)."""
    arguments: str
    """The tool's input as the model wrote it (an expression, a program)."""


@dataclass(frozen=True)
class ToolResult:
    output: str
    """What the model sees next (already truncated to the configured size)."""
    ok: bool = True
    error: str | None = None
    """Why the call failed, as a short reason (`timeout`, `error`, `memory`, `output_too_large`, ...)."""
    seconds: float = 0.0


class ToolInfraError(RuntimeError):
    """The executor could not run the call (worker died, sandbox did not start); `reason` is a short label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    def __reduce__(self):
        """Crossing Ray (raised in a tool worker, re-raised in its caller) keeps `reason` a short label."""
        return (type(self), (self.reason, self.detail))


class RewardError(RuntimeError):
    """A user reward raised, returned a non-number or ran past its timeout; the trajectory fails with this text."""


@runtime_checkable
class ToolExecutor(Protocol):
    """Runs tools and rewards for a rollout worker. Implementations must be picklable (they travel inside the
    rollout worker's `WorkerSpec`)."""

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult: ...

    async def reward(
        self,
        reward: str,
        response: str,
        ground_truth: str,
        *,
        finish_reason: str,
        extra_info: dict[str, Any],
        timeout_s: float,
    ) -> float: ...


class InProcessTools:
    """Runs the built-in calculator and rewards in the rollout worker's own process (a thread per reward, except
    the `rewards.INLINE` ones, called directly).

    For unit tests and trusted built-in rewards only: nothing is sandboxed and a timed-out reward thread cannot
    be killed (it is abandoned). Runs with user code use the sandboxed tool-worker pool.
    """

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        began = time.perf_counter()
        if call.name != "calculator":
            return ToolResult(f"unknown tool {call.name!r}", ok=False, error="unknown_tool")
        try:
            output = calculate(call.arguments)
        except ValueError as e:
            return ToolResult(f"error: {e}", ok=False, error="error", seconds=time.perf_counter() - began)
        return ToolResult(output, seconds=time.perf_counter() - began)

    async def reward(
        self,
        reward: str,
        response: str,
        ground_truth: str,
        *,
        finish_reason: str,
        extra_info: dict[str, Any],
        timeout_s: float,
    ) -> float:
        from asyncrl.envs.rewards import INLINE, resolve_reward

        fn = resolve_reward(reward)
        try:
            if reward in INLINE:
                value = fn(response, ground_truth, finish_reason=finish_reason, extra_info=dict(extra_info))
            else:
                work = asyncio.to_thread(
                    fn, response, ground_truth, finish_reason=finish_reason, extra_info=dict(extra_info)
                )
                value = await asyncio.wait_for(work, timeout=timeout_s)
        except TimeoutError:
            raise RewardError(f"timed out after {timeout_s}s") from None
        except Exception as e:
            raise RewardError(f"{type(e).__name__}: {e}") from None
        return check_reward_value(value)


def check_reward_value(value: Any) -> float:
    """A reward must be a finite real number (bool and numpy scalars included); raise `RewardError` otherwise."""
    import math

    if isinstance(value, (str, bytes)):  # float("1.0") would hide a bug in the reward
        raise RewardError(f"returned {type(value).__name__} {value!r}, not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"returned {type(value).__name__} {value!r}, not a number") from None
    if not math.isfinite(number):
        raise RewardError(f"non-finite reward {value!r}")
    return number
