"""Sandbox start overhead: N `python` tool calls through one in-process `Sandbox` (no Ray), each taking the
process started ahead, and the first call of a user reward (its process start and its module's import).

    python benchmarks/sandbox_start.py [N]      # prints one JSON line

Figures: benchmarks/notes/agent_tool.md ("Sandbox start").
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from asyncrl.envs.tools.processes import RewardItem
from asyncrl.envs.tools.python import run_python
from asyncrl.envs.tools.sandbox import Sandbox, SandboxLimits

REWARD = "asyncrl.envs.rewards:exact_match"


def _sandbox() -> Sandbox:
    """As a tool worker holds it: told the run's reward, so that its process is started ahead too (code before
    that had no `code` field: one spare, taken by whichever call comes first)."""
    try:
        from asyncrl.envs.tools.mounts import reward_code
    except ImportError:
        return Sandbox(SandboxLimits(), 230_000)
    return Sandbox(SandboxLimits(), 230_000, code={REWARD: reward_code(REWARD)})


async def measure(n: int) -> dict[str, float]:
    sandbox = _sandbox()
    sandbox.warm()
    await asyncio.sleep(1.0)
    walls = []
    try:
        for _ in range(n):
            began = time.perf_counter()
            result = await run_python(sandbox, "print(1)", 10.0)
            walls.append(time.perf_counter() - began)
            assert result.ok, result.output
        began = time.perf_counter()
        (outcome,) = await sandbox.run_rewards(
            "asyncrl.envs.rewards:exact_match", [RewardItem("1", "1", "stop", {}, 10.0)]
        )
        reward_first = time.perf_counter() - began
        assert outcome.value == 1.0, outcome
    finally:
        await sandbox.close()
    ms = sorted(1000 * w for w in walls)
    return {
        "calls": n,
        "start_p50_ms": 1000 * statistics.median(sandbox.start_seconds),
        "call_p50_ms": statistics.median(ms),
        "call_p90_ms": ms[int(0.9 * (n - 1))],
        "reward_first_call_ms": 1000 * reward_first,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 40))))
