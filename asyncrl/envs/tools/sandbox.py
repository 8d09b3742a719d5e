"""Untrusted code (a model's Python program, a user's reward) run in a sandboxed process with limits, so that
nothing it does reaches the tool worker, the engines or the machine.

How (see docs/tools.md):
- with bubblewrap (`bwrap`), every run sees none of the host's files but the system's programs and libraries
  and the interpreter's installation (read-only, `mounts.py`), gets its own `/tmp` (a small tmpfs: its only
  writable place, invisible to every other run), a minimal `/dev`, and new network, PID, IPC and UTS
  namespaces (no network at all; its processes die with it); a user reward's process also sees the code
  folders it imports and `tools.reward_mounts` (read-only), never the run folder or the datasets. When we are
  root, every process runs under an unprivileged uid no other live process of the sandbox holds (root ignores
  RLIMIT_NPROC and could write anywhere; a shared uid would pool RLIMIT_NPROC and let runs signal each other);
- inside, before any user code, the runner sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and RLIMIT_FSIZE; the
  parent enforces the wall time by killing the run's whole process group;
- stdout and stderr are read in bounded chunks: only `output_bytes` of each are kept.
Without bwrap only the resource limits (and a uid drop when possible) hold; `isolation.detect_capabilities` says
exactly what this machine gives, and `asyncrl check` prints it.

The pieces: `isolation` (what confines a run, the uid lease), `processes` (a run's process and its pipes),
`runner` (the program that runs inside, started as a file).

Start-up is kept off the call's path: each `Sandbox` keeps one process started ahead ("spare") for programs,
and one for each reward it served (their mounts differ), waiting for its payload on stdin; a call takes it
and starts the next. Every program runs in a fresh process. A user
reward's process imports its module once and is kept for `reward_process_calls` calls (batches of them, one
JSON line each way per call), each call under its own wall and CPU timers.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.envs.tools.base import ToolInfraError
from asyncrl.envs.tools.isolation import (
    RUNNER_MOUNT,
    UIDS_PER_SANDBOX,
    Capabilities,
    base_python,
    bwrap_prefix,
    clean_env,
    detect_capabilities,
    drop_to,
    staged_runner,
)
from asyncrl.envs.tools.mounts import RewardCode, interpreter_site_packages, reward_code
from asyncrl.envs.tools.processes import (
    ItemOutcome,
    RewardItem,
    RewardProcess,
    Started,
    Tail,
    after_kill,
    drain,
    exit_reason,
    kill,
    pipes,
    remove,
)
from asyncrl.envs.tools.runner import READY

__all__ = ["RunOutcome", "Sandbox", "SandboxLimits"]


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; `ToolsConfig` sets them (`SandboxLimits.from_config`)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS): a 4 GiB allocation under a 1 GiB limit fails with MemoryError."""
    processes: int = 16
    """RLIMIT_NPROC of the run's own uid: a fork bomb stops there."""
    file_bytes: int = 8 << 20
    """Largest file the run may write (RLIMIT_FSIZE); its /tmp tmpfs is sized the same."""
    output_bytes: int = 4096
    """stdout and stderr are each cut to this many bytes (stdout's first, stderr's last)."""

    @classmethod
    def from_config(cls, tools: Any) -> SandboxLimits:
        return cls(
            wall_s=tools.call_timeout_s, cpu_s=tools.cpu_time_s, memory_bytes=tools.memory_mb << 20,
            processes=tools.max_processes, file_bytes=tools.tmp_mb << 20, output_bytes=tools.output_bytes,
        )  # fmt: skip

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_CPU": self.cpu_s,
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_FSIZE": self.file_bytes,
        }


@dataclass
class RunOutcome:
    """How one sandboxed run ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str | None
    """None when it exited 0; else `timeout` (wall), `cpu_time`, `memory`, `output_limit` (file size) or `error`."""
    seconds: float
    pid: int
    """The run's host process (bwrap's, or the interpreter's): gone once the outcome exists."""
    truncated_bytes: int = 0


@dataclass
class Sandbox:
    """Runs each program in its own process and rewards in processes kept per reward, with one process kept
    started ahead. One per tool worker;
    `uid` is the first of the `UIDS_PER_SANDBOX` unprivileged uids its processes run under when we are root: one
    per live process, so that RLIMIT_NPROC counts each run's own processes (tool workers get disjoint blocks)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    uid: int = 200_000
    reward_process_calls: int = 1024
    """Calls one reward process serves before a fresh one replaces it (1: every call in its own process)."""
    start_seconds: list[float] = field(default_factory=list)
    """How long each started process took to be ready (the benchmark's sandbox start)."""
    code: dict[str, RewardCode] = field(default_factory=dict)
    """Each reward's code folders as the driver resolved them (`mounts.reward_code`); this process adds its own."""
    reward_mounts: tuple[str, ...] = ()
    """Host paths every reward process also sees, read-only (`tools.reward_mounts`)."""
    _spares: dict[str, asyncio.Task] = field(default_factory=dict)
    """The process started ahead for programs (key "") and for each reward (its `module:function`)."""
    _idle: dict[str, list[RewardProcess]] = field(default_factory=dict)
    """Reward processes waiting for their next batch, by reward."""
    _leased: set[int] = field(default_factory=set)
    """Uids of the processes started and not yet ended."""
    _next_uid: int = 0
    """Where the round-robin search for a free uid starts (offset in the block)."""

    @property
    def capabilities(self) -> Capabilities:
        return detect_capabilities()

    async def run_program(self, source: str, timeout_s: float | None = None) -> RunOutcome:
        return await self._run({"kind": "program", "source": source}, timeout_s or self.limits.wall_s)

    async def run_rewards(self, reward: str, items: Sequence[RewardItem]) -> list[ItemOutcome]:
        """Call the user's `module:function` on every item, in order, in a sandboxed process that imported the
        module once and is kept for the next batch (up to `reward_process_calls` calls). Each item runs under
        its own wall (`timeout_s`) and CPU (`cpu_s`) limits. An item that takes the process down (a crash, a
        limit it swallowed) fails alone; the items after it run in a fresh process."""
        process = (
            self._idle.get(reward, []).pop()
            if self._idle.get(reward)
            else await self._start_reward(reward, items[0].timeout_s)
        )
        try:
            lines, failed = await process.score(items)
        except BaseException:  # cancelled: the process is in the middle of a batch nobody waits for
            await asyncio.shield(self._retire(process))
            raise
        if lines and "import_error" in lines[0]:
            await self._retire(process)
            return [ItemOutcome(reason="import_error", detail=lines[0]["import_error"])] * len(items)
        done = [
            ItemOutcome(line.get("value"), line.get("reason"), line.get("detail", ""), line.get("seconds", 0.0))
            for line in lines
        ]
        if failed is None:
            if process.calls < self.reward_process_calls:
                self._idle.setdefault(reward, []).append(process)
            else:
                await self._retire(process)
            return done
        self._leased.discard(process.started.uid)  # `score` retired it
        rest = items[len(done) + 1 :]
        return done + [failed] + (await self.run_rewards(reward, rest) if rest else [])

    async def _start_reward(self, reward: str, import_timeout_s: float) -> RewardProcess:
        """A process that imports `reward`'s module within `import_timeout_s` (the answer to a failed import comes
        with the first batch) and then serves batches."""
        path = list(self._code(reward).path)
        limits = {
            **self.limits.rlimits(),
            "RLIMIT_CPU": self.limits.cpu_s * self.reward_process_calls + 1,
        }  # each call: its CPU timer
        payload = {
            "kind": "rewards",
            "reward": reward,
            "path": path,
            "cpu_s": self.limits.cpu_s,
            "import_timeout_s": import_timeout_s,
            "limits": limits,
        }
        started = await self._take(reward)
        stdin, _, stderr = pipes(started.process)
        stdin.write(json.dumps(payload).encode() + b"\n")
        return RewardProcess(started, Tail(stderr, self.limits.output_bytes))

    def _code(self, reward: str) -> RewardCode:
        """What `reward`'s process imports from: the interpreter's own folders, then its code folders as the
        driver found them, then as this process finds them (either may lack the module)."""
        own = tuple(os.path.realpath(p) for p in sys.path if p and _under(p, sys.base_prefix) and os.path.isdir(p))
        return RewardCode((), own).merged(self.code.get(reward, RewardCode((), ()))).merged(reward_code(reward))

    def warm(self) -> None:
        """Start the first process ahead for programs and for each reward the driver named (`code`), so that
        even the first call finds one ready."""
        for reward in ["", *self.code]:
            if reward not in self._spares:
                self._spares[reward] = asyncio.ensure_future(self._start(reward or None))

    async def close(self) -> None:
        """Stop the pre-started process (one that failed to start has nothing to stop) and the idle reward ones."""
        idle, self._idle = [p for ps in self._idle.values() for p in ps], {}
        for process in idle:
            await self._retire(process)
        spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            try:
                started = await spare
            except ToolInfraError:
                continue
            kill(started.process)
            await started.process.wait()
            remove(started.workdir)
            self._leased.discard(started.uid)

    async def _retire(self, process: RewardProcess) -> None:
        await process.retire()
        self._leased.discard(process.started.uid)

    async def _run(self, payload: dict[str, Any], timeout_s: float) -> RunOutcome:
        started = await self._take()
        payload["limits"] = self.limits.rlimits()
        began = time.perf_counter()
        process = started.process
        stdin, stdout, stderr = pipes(process)
        try:
            stdin.write(json.dumps(payload).encode())
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading: its exit status says why
        keep = self.limits.output_bytes
        reading = asyncio.gather(drain(stdout, keep), drain(stderr, keep, tail=True))
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(asyncio.shield(reading), timeout_s)
            await process.wait()
            timed_out = False
        except TimeoutError:
            kill(process)
            (out, out_cut), (err, err_cut) = await after_kill(reading, (("", 0), ("", 0)))
            await process.wait()
            timed_out = True
        except BaseException:  # cancelled: the run must not outlive its call (nor keep its uid)
            kill(process)
            await asyncio.shield(process.wait())
            raise
        finally:
            remove(started.workdir)
            self._leased.discard(started.uid)
        code = process.returncode
        reason = exit_reason(code, err, timed_out)
        return RunOutcome(out, err, code, reason, time.perf_counter() - began, process.pid, out_cut + err_cut)

    async def _take(self, reward: str | None = None) -> Started:
        """The spare process for a program or `reward` (started now if there is none), once it is ready; the next
        one starts meanwhile."""
        key = reward or ""
        spare = self._spares.get(key) or asyncio.ensure_future(self._start(reward))
        self._spares[key] = asyncio.ensure_future(self._start(reward))
        return await spare

    async def _start(self, reward: str | None) -> Started:
        began = time.perf_counter()
        uid = self._lease_uid()
        try:
            argv, workdir = self._command(uid, reward)
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir or "/",
                env=clean_env(workdir), start_new_session=True,
            )  # fmt: skip
            _, stdout, stderr = pipes(process)
            ready = await stdout.read(1)
            if ready != READY:
                await process.wait()
                detail = (await stderr.read(2000)).decode(errors="replace").strip()
                raise ToolInfraError("sandbox_start_failed", f"exit {process.returncode}: {detail}")
        except BaseException:
            self._leased.discard(uid)
            raise
        self.start_seconds.append(time.perf_counter() - began)
        return Started(process, began, uid, workdir)

    def _lease_uid(self) -> int:
        """A uid of this sandbox's block that no live process of it holds, round robin, so that a uid is reused
        as late as possible (an `rlimits` run can leave a process behind, which keeps its uid)."""
        for k in range(UIDS_PER_SANDBOX):
            offset = (self._next_uid + k) % UIDS_PER_SANDBOX
            if self.uid + offset not in self._leased:
                self._next_uid = offset + 1
                self._leased.add(self.uid + offset)
                return self.uid + offset
        raise ToolInfraError(
            "sandbox_busy", f"all {UIDS_PER_SANDBOX} uids from {self.uid} are held by running or kept processes"
        )

    def _command(self, uid: int, reward: str | None) -> tuple[list[str], str | None]:
        """argv, and the host work folder of an `rlimits` run (bwrap runs use their own tmpfs). A program's run
        sees no host path and none of the interpreter's site-packages; `reward`'s sees its code folders and
        `reward_mounts`."""
        caps = self.capabilities
        root = os.geteuid() == 0
        bwrap = shutil.which("bwrap") if caps.method == "bwrap" else None
        if bwrap is not None:
            binds = [*self._code(reward).binds, *self.reward_mounts] if reward else []
            hide = [] if reward else interpreter_site_packages()  # a program: the standard library alone
            prefix = bwrap_prefix(bwrap, uid if root else None, self.limits.file_bytes, staged_runner(), binds, hide)
            return prefix + [base_python(), "-I", RUNNER_MOUNT], None
        user = uid if caps.uid_dropped else None
        workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        if user is not None:
            os.chown(workdir, user, user)  # 0700: only this run's uid enters it
        return drop_to(user) + [base_python(), "-I", staged_runner()], workdir


def _under(path: str, folder: str) -> bool:
    path = os.path.abspath(path)
    return path == folder or path.startswith(folder + os.sep)
