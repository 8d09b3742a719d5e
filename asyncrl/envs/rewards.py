"""Reward verifiers: pure functions of the response text.

Signature of every reward function (built-in or user `module:function`):
    fn(response: str, ground_truth: str, *, finish_reason: str, extra_info: dict) -> float
A reward that raises marks its trajectory `failed:reward_error` (the run goes on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.lookup import load_plugin


class RewardFn(Protocol):
    def __call__(
        self, response: str, ground_truth: str, *, finish_reason: str, extra_info: dict[str, Any]
    ) -> float: ...


def exact_match(
    response: str, ground_truth: str, *, finish_reason: str = "stop", extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 iff the response is exactly the ground truth and ended with end-of-sequence (W1 `add`)."""
    return 1.0 if finish_reason == "stop" and response.strip() == ground_truth.strip() else 0.0


def math_verify(
    response: str, ground_truth: str, *, finish_reason: str = "stop", extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 iff `math-verify` finds the response's answer equal to the ground truth and the response ended with
    end-of-sequence. Its own timeouts are signal-based (main thread only, and they would fire in the rollout
    worker's event loop), so they are turned off here: the reward runs under `env.reward_timeout_s` in the
    tool executor instead."""
    if finish_reason != "stop":
        return 0.0
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeout is off
    gold = parse(ground_truth, parsing_timeout=None)
    answer = parse(response, parsing_timeout=None)
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


BUILTIN: dict[str, Callable[..., float]] = {"exact_match": exact_match, "math_verify": math_verify}
INLINE = frozenset({"exact_match"})
"""Built-ins cheap and bounded enough (a string comparison) to run on the caller's event loop: a thread hop per
trajectory cost ~10% of a W1 rollout worker's CPU. Every other reward runs in a thread under a timeout."""


def resolve_reward(name: str) -> RewardFn:
    """A built-in name or an import path `package.module:function`."""
    fn = load_plugin(name, "reward", BUILTIN, form="module:function")
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn
