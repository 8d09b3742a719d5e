"""Waiting on another process's answer: always with a timeout, and an error that says what was waited for
and on whom (a bare `GetTimeoutError` says neither). Calls with their own richer handling (the learner
ranks, the weight sync, the replay queue) keep it; this is for the plain `ray.get` of one call."""

from __future__ import annotations

from typing import Any


class CallTimeout(TimeoutError):
    """A call to another process got no answer in time; the message names the call and whom it waited on."""


def named_get(refs: Any, timeout_s: float, what: str) -> Any:
    """`ray.get(refs, timeout=timeout_s)`; past it, `CallTimeout("<what>: no answer within <t>s")`."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CallTimeout(f"{what}: no answer within {timeout_s:g}s") from None
