"""The processes of a sandboxed run, seen from the tool worker: a started runner, the bounded reads of its pipes,
a reward process kept for batch after batch, and how a run's exit status reads as a reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.envs.tools.runner import MEMORY_EXIT

__all__ = [
    "ItemOutcome",
    "RewardItem",
    "RewardProcess",
    "Started",
    "Tail",
    "drain",
    "exit_reason",
    "kill",
    "pipes",
    "remove",
]

ITEM_GRACE_S = 1.0
"""How long past an item's own timeout the tool worker waits for its answer before killing the run: its timer
inside the run normally answers `timeout` first; this catches a reward that blocks signals or swallows them."""


@dataclass(frozen=True)
class RewardItem:
    """One call of a user reward: its arguments and its own wall-time limit."""

    response: str
    ground_truth: str
    finish_reason: str
    extra_info: dict[str, Any]
    timeout_s: float


@dataclass(frozen=True)
class ItemOutcome:
    """How one reward call of a batch ended: `value` (the number, or the repr of what the reward returned
    instead) when `reason` is None; else `reason` (`timeout`, `cpu_time`, `memory`, `error`, `import_error`)
    and the last line of what went wrong in `detail`."""

    value: Any = None
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Started:
    process: asyncio.subprocess.Process
    began: float
    uid: int
    """The uid leased to it (`Sandbox._lease_uid`), whether or not the run dropped to it."""
    workdir: str | None = None
    """The host folder of an `rlimits` run (removed after it); bwrap runs use their own tmpfs."""


class Tail:
    """The last `keep` bytes of a stream, read as it comes (a long-lived process must not block on a full pipe)."""

    def __init__(self, stream: asyncio.StreamReader, keep: int) -> None:
        self.kept, self.keep = bytearray(), keep
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.kept = (self.kept + chunk)[-self.keep :]

    async def last_line(self) -> str:
        """The last line written so far (after the stream's end, once the process is gone)."""
        await after_kill(asyncio.shield(self.task), None)
        return (self.kept.decode(errors="replace").strip().splitlines() or ["exited before answering"])[-1][-300:]


@dataclass
class RewardProcess:
    """A sandboxed process serving one reward, batch after batch."""

    started: Started
    stderr: Tail
    calls: int = 0

    async def score(self, items: Sequence[RewardItem]) -> tuple[list[dict[str, Any]], ItemOutcome | None]:
        """Send one batch and read one JSON line per item, each within its item's `timeout_s` (+ grace). -> (the
        lines read, None; or the lines read and the outcome of the item the process went down on, then killed)."""
        process, timed_out = self.started.process, False
        stdin, stdout, _ = pipes(process)
        lines: list[dict[str, Any]] = []
        began = time.perf_counter()
        try:
            stdin.write(json.dumps([asdict(i) for i in items]).encode() + b"\n")
            await stdin.drain()
            while len(lines) < len(items):
                line = await asyncio.wait_for(item_line(stdout), items[len(lines)].timeout_s + ITEM_GRACE_S)
                if line is None:
                    break  # it exited
                lines.append(line)
                if "import_error" in line:
                    return lines, None
        except TimeoutError:
            timed_out = True
        except (BrokenPipeError, ConnectionResetError):
            pass  # it is gone: its exit status says why
        self.calls += len(lines)
        if len(lines) == len(items):
            return lines, None
        await self.retire()
        seconds = max(0.0, time.perf_counter() - began - sum(line.get("seconds", 0.0) for line in lines))
        err = await self.stderr.last_line()
        code = process.returncode
        return lines, ItemOutcome(reason=exit_reason(code, err, timed_out) or "error", detail=err, seconds=seconds)

    async def retire(self) -> None:
        """Kill the process (its pipes close with it) and remove its work folder."""
        kill(self.started.process)
        await self.started.process.wait()
        remove(self.started.workdir)


def pipes(
    process: asyncio.subprocess.Process,
) -> tuple[asyncio.StreamWriter, asyncio.StreamReader, asyncio.StreamReader]:
    """(stdin, stdout, stderr) of a run's process: every run is started with all three piped."""
    if process.stdin is None or process.stdout is None or process.stderr is None:
        raise ValueError(f"process {process.pid} was started without its pipes")
    return process.stdin, process.stdout, process.stderr


async def drain(stream: asyncio.StreamReader, keep: int, tail: bool = False) -> tuple[str, int]:
    """Read a stream to its end keeping its first `keep` bytes (its last with `tail`: where a traceback says
    what went wrong); the text and how many bytes were cut."""
    kept, total = bytearray(), 0
    while chunk := await stream.read(65536):
        total += len(chunk)
        kept = (kept + chunk)[-keep:] if tail else kept + chunk[: keep - len(kept)]
    return kept.decode(errors="replace"), total - len(kept)


async def item_line(stdout: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next answer line of a reward run (lines that are not one are skipped); None once stdout ends."""
    while True:
        try:
            raw = await stdout.readline()
        except ValueError:  # a line past the stream's limit: not one of the runner's
            continue
        if not raw:
            return None
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and ("value" in line or "reason" in line or "import_error" in line):
            return line


async def after_kill(reading: Any, empty: Any) -> Any:
    """What a killed run's pipes held; `empty` when a process that left the group (rlimits only) still holds them."""
    try:
        return await asyncio.wait_for(reading, 2.0)
    except TimeoutError:
        return empty


def exit_reason(code: int | None, stderr: str, timed_out: bool) -> str | None:
    if timed_out:
        return "timeout"
    if code == 0:
        return None
    if code == MEMORY_EXIT or (code == 1 and stderr.rstrip().endswith("MemoryError")):
        return "memory"
    if code in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu_time"  # RLIMIT_CPU: SIGXCPU at the soft limit (bwrap reports it as 128 + signal)
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
        return "output_limit"
    return "error"


def kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the run's whole session: bwrap's PID namespace then takes every process in it down too."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove(workdir: str | None) -> None:
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
