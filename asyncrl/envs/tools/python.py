"""The `python` tool: the model's program runs in a sandbox (asyncrl/envs/tools/sandbox.py); what it printed comes
back as the next observation. A program that fails, times out, or runs out of memory is the model's problem:
the result says so (`ok=False`, `error=<reason>`) and the episode goes on."""

from __future__ import annotations

from asyncrl.envs.tools.base import ToolResult
from asyncrl.envs.tools.sandbox import RunOutcome, Sandbox


async def run_python(sandbox: Sandbox, source: str, timeout_s: float) -> ToolResult:
    return python_result(await sandbox.run_program(source, timeout_s))


def python_result(outcome: RunOutcome) -> ToolResult:
    """stdout, then stderr (a traceback), then a note of what was cut or why the run ended."""
    text = outcome.stdout + outcome.stderr
    if outcome.truncated_bytes:
        text += f"\n[output truncated: {outcome.truncated_bytes} bytes not shown]"
    if outcome.reason is not None and outcome.reason != "error":
        text += f"\n[{_EXPLAIN.get(outcome.reason, outcome.reason)}]"
    return ToolResult(text, ok=outcome.reason is None, error=outcome.reason, seconds=outcome.seconds)


_EXPLAIN = {
    "timeout": "stopped: wall-time limit",
    "cpu_time": "stopped: CPU-time limit",
    "memory": "stopped: memory limit",
    "output_limit": "stopped: file-size limit",
}
