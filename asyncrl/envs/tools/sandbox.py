"""Untrusted code (a model's Python program, a user's reward) run in a sandboxed process with limits, so that
nothing it does reaches the tool worker, the engines or the machine.

How (see docs/tools.md):
- with bubblewrap (`bwrap`), every run gets a read-only view of `/`, its own `/tmp` (a small tmpfs: its only
  writable place, invisible to every other run), an empty `/run`, a minimal `/dev`, and new network, PID, IPC
  and UTS namespaces (no network at all; its processes die with it). When we are root, every process runs
  under an unprivileged uid no other live process of the sandbox holds (root ignores RLIMIT_NPROC and could
  write anywhere; a shared uid would pool RLIMIT_NPROC and let runs signal each other);
- inside, before any user code, the runner sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and RLIMIT_FSIZE; the
  parent enforces the wall time by killing the run's whole process group;
- stdout and stderr are read in bounded chunks: only `output_bytes` of each are kept.
Without bwrap only the resource limits (and a uid drop when possible) hold; `detect_capabilities` says exactly
what this machine gives, and `asyncrl check` prints it.

Start-up is kept off the call's path: each `Sandbox` keeps one process started ahead ("spare"), waiting for
its payload on stdin; a call takes it and starts the next. Every program runs in a fresh process. A user
reward's process imports its module once and is kept for `reward_process_calls` calls (batches of them, one
JSON line each way per call), each call under its own wall and CPU timers.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.envs.tools.base import ToolInfraError

PYTHON_MOUNT = "/run/python"
"""Where the interpreter's installation is mounted inside a bwrap sandbox: its real prefix may sit in a folder
the sandbox's unprivileged uid cannot enter (e.g. /root/.pyenv)."""
ITEM_GRACE_S = 1.0
"""How long past an item's own timeout the tool worker waits for its answer before killing the run: its timer
inside the run normally answers `timeout` first; this catches a reward that blocks signals or swallows them."""
READY = b"R"
"""The byte a started runner writes once it waits for its payload (its start time ends there)."""
MEMORY_EXIT = 3
"""Exit status of a runner whose code raised MemoryError (RLIMIT_AS hit)."""
UIDS_PER_SANDBOX = 64
"""The uids one sandbox (one tool worker) gives its live processes, one each (`Sandbox._lease_uid`): running
programs, kept reward processes and the spare. RLIMIT_NPROC counts per uid."""
UID_LOCKS = Path(tempfile.gettempdir()) / "asyncrl-sandbox-uids"
"""One lock file per leased block of uids on this machine (`lease_uid_block`)."""
UID_BLOCKS = 1024
"""How many blocks from `tools.sandbox_uid_base` a tool worker tries before it gives up."""

# Runs inside the sandbox. Reads one JSON line (the payload), sets the limits, then runs the program or serves
# the rewards: the user's module is imported once, then each line on stdin is a batch of calls, each run under
# its own wall (ITIMER_REAL) and CPU (ITIMER_PROF) timers; one JSON line per call goes to stdout, the reward's
# prints to stderr.
RUNNER = r"""
import ctypes, json, os, resource, signal, sys, time, traceback
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a kept reward process dies with its tool worker
os.write(1, b"R")
payload = json.loads(sys.stdin.buffer.readline())
for name, value in payload["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))

class Limit(BaseException):
    pass

def on_limit(signum, frame):
    raise Limit("timeout" if signum == signal.SIGALRM else "cpu_time")

def last_line(e):
    return traceback.format_exception_only(type(e), e)[-1].strip()[-300:]

def score(fn, item, out):
    began = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, item["timeout_s"])
    signal.setitimer(signal.ITIMER_PROF, payload["cpu_s"])
    try:
        value = fn(item["response"], item["ground_truth"], finish_reason=item["finish_reason"], extra_info=item["extra_info"])
        line = {"value": float(value) if isinstance(value, (int, float)) else repr(value)}
    except Limit as e:
        line = {"reason": str(e)}
    except MemoryError:
        line = {"reason": "memory"}
    except BaseException as e:
        line = {"reason": "error", "detail": last_line(e)}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
    line["seconds"] = time.perf_counter() - began
    out.write(json.dumps(line) + "\n")
    out.flush()

try:
    if payload["kind"] == "program":
        exec(compile(payload["source"], "<program>", "exec"), {"__name__": "__main__"})
    else:
        sys.path[:0] = payload["path"]
        out, sys.stdout = sys.stdout, sys.stderr
        signal.signal(signal.SIGALRM, on_limit)
        signal.signal(signal.SIGPROF, on_limit)
        signal.setitimer(signal.ITIMER_REAL, payload["import_timeout_s"])
        try:
            module, attr = payload["reward"].split(":", 1)
            fn = getattr(__import__(module, fromlist=[attr]), attr)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:
            error = f"importing it took over {payload['import_timeout_s']}s" if isinstance(e, Limit) else last_line(e)
            out.write(json.dumps({"import_error": error}) + "\n")
            out.flush()
            os._exit(0)
        for batch in sys.stdin.buffer:  # one line per batch, until the tool worker closes stdin
            for item in json.loads(batch):
                score(fn, item, out)
except MemoryError:
    os.write(2, b"MemoryError\n")
    os._exit(3)
except SystemExit as e:
    sys.stdout.flush()
    os._exit(e.code if isinstance(e.code, int) else 1)
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the user's frame on
    sys.stdout.flush()
    os._exit(1)
sys.stdout.flush()
os._exit(0)
"""


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


@dataclass(frozen=True)
class Capabilities:
    """What isolation this machine gives a sandboxed run (logged once per tool worker, shown by `asyncrl check`)."""

    method: str
    """`bwrap` (namespaces + limits) or `rlimits` (resource limits only)."""
    network_isolated: bool
    pid_namespace: bool
    readonly_root: bool
    private_tmp: bool
    """The run's writable directory is invisible to every other run."""
    uid_dropped: bool
    nproc_enforced: bool
    """RLIMIT_NPROC holds (it does not for uid 0)."""
    detail: str = ""

    def __str__(self) -> str:
        flags = ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in asdict(self).items() if isinstance(v, bool))
        return f"sandbox: {self.method} ({flags}){': ' + self.detail if self.detail else ''}"


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


@functools.lru_cache(maxsize=1)
def detect_capabilities() -> Capabilities:
    """Probe once: run a trivial command under bwrap and see whether the namespaces come up."""
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if bwrap:
        probe = subprocess.run(_bwrap_prefix(bwrap, None, 1 << 20) + ["true"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return Capabilities("bwrap", True, True, True, True, uid_dropped=root, nproc_enforced=True)
        reason = f"bwrap is installed but failed: {probe.stderr.decode(errors='replace').strip()[:200]}"
    else:
        reason = "bwrap not found (Debian package `bubblewrap`)"
    can_drop = root and _nobody_can_run_python()
    return Capabilities(
        "rlimits", False, False, False, private_tmp=can_drop, uid_dropped=can_drop, nproc_enforced=can_drop or not root,
        detail=reason + "; no network, PID or filesystem isolation",
    )  # fmt: skip


def _nobody_can_run_python() -> bool:
    """Whether an unprivileged uid can start this interpreter in place (its prefix is world-readable)."""
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in _parents(sys._base_executable))


def _parents(path: str) -> list[str]:
    parts = os.path.realpath(path).split(os.sep)
    return [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]


def lease_uid_block(base: int, locks: Path = UID_LOCKS, blocks: int = UID_BLOCKS) -> tuple[int, int | None]:
    """The first block of `UIDS_PER_SANDBOX` uids from `base` that no other sandbox on this machine holds and no
    live process runs under, and the open lock file that holds it (`flock`: released when its process exits,
    however it dies). Runs that share a machine (two jobs on one node, two test files) never share a uid, so
    they neither pool RLIMIT_NPROC nor can signal each other's processes. Without root no uid is dropped to,
    so there is nothing to lease: `(base, None)`."""
    if os.geteuid() != 0:
        return base, None
    locks.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(locks)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise ToolInfraError("sandbox_uids", f"{locks} must be a directory owned by root and writable only by it")
    live = _live_uids()
    for first in range(base, base + UIDS_PER_SANDBOX * blocks, UIDS_PER_SANDBOX):
        if live.intersection(range(first, first + UIDS_PER_SANDBOX)):
            continue  # a process left behind (an `rlimits` run) still holds a uid of it
        fd = os.open(locks / str(first), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return first, fd
    raise ToolInfraError(
        "sandbox_busy", f"no free block of {UIDS_PER_SANDBOX} uids among {blocks} from {base} (locks in {locks})"
    )


def _live_uids() -> set[int]:
    """The real uids of this machine's live processes (this PID namespace's)."""
    uids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uids.add(int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1]))
        except (OSError, StopIteration, ValueError):
            continue
    return uids


def _bwrap_prefix(bwrap: str, uid: int | None, tmp_bytes: int) -> list[str]:
    """bwrap's arguments: read-only `/`, own `/tmp`, `/dev`, `/proc`, an empty `/run` holding the interpreter, and
    every namespace but the user's (we may be root); `setpriv` then drops to `uid` with no capabilities."""
    args = [
        bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/run",
        "--ro-bind", sys.base_prefix, PYTHON_MOUNT, "--perms", "01777", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
        *_code_under_tmp(),
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session", "--chdir", "/tmp",
    ]  # fmt: skip
    return args + _drop_to(uid)


def _code_under_tmp() -> list[str]:
    """Read-only binds of the folders the run imports from that its own `/tmp` and `/run` would hide (a checkout
    or virtual environment under /tmp, as in CI): the entries of `sys.path`, the environment and this package."""
    import asyncrl

    roots = {
        os.path.realpath(p or ".") for p in [*sys.path, sys.prefix, os.path.dirname(os.path.dirname(asyncrl.__file__))]
    }
    hidden = sorted(p for p in roots if p.startswith(("/tmp/", "/run/")) and os.path.isdir(p))
    return [arg for p in hidden for arg in ("--ro-bind", p, p)]


def _drop_to(uid: int | None) -> list[str]:
    """The command prefix that runs the rest as `uid`, without groups or capabilities (none for None)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]


def _inside_path(entry: str) -> str:
    """A host `sys.path` entry as the sandbox sees it (the interpreter's prefix is mounted elsewhere)."""
    entry = os.path.abspath(entry or ".")
    if entry == sys.base_prefix or entry.startswith(sys.base_prefix + os.sep):
        return PYTHON_MOUNT + entry[len(sys.base_prefix) :]
    return entry


@dataclass
class _Started:
    process: asyncio.subprocess.Process
    began: float
    uid: int
    """The uid leased to it (`Sandbox._lease_uid`), whether or not the run dropped to it."""
    workdir: str | None = None
    """The host folder of an `rlimits` run (removed after it); bwrap runs use their own tmpfs."""


class _Tail:
    """The last `keep` bytes of a stream, read as it comes (a long-lived process must not block on a full pipe)."""

    def __init__(self, stream: asyncio.StreamReader, keep: int) -> None:
        self.kept, self.keep = bytearray(), keep
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.kept = (self.kept + chunk)[-self.keep :]

    async def last_line(self) -> str:
        """The last line written so far (after the stream's end, once the process is gone)."""
        await _after_kill(asyncio.shield(self.task), None)
        return (self.kept.decode(errors="replace").strip().splitlines() or ["exited before answering"])[-1][-300:]


@dataclass
class _RewardProcess:
    """A sandboxed process serving one reward, batch after batch."""

    started: _Started
    stderr: _Tail
    calls: int = 0

    async def score(self, items: Sequence[RewardItem]) -> tuple[list[dict[str, Any]], ItemOutcome | None]:
        """Send one batch and read one JSON line per item, each within its item's `timeout_s` (+ grace). -> (the
        lines read, None; or the lines read and the outcome of the item the process went down on, then killed)."""
        process, lines, timed_out = self.started.process, [], False
        began = time.perf_counter()
        try:
            process.stdin.write(json.dumps([asdict(i) for i in items]).encode() + b"\n")
            await process.stdin.drain()
            while len(lines) < len(items):
                line = await asyncio.wait_for(_item_line(process.stdout), items[len(lines)].timeout_s + ITEM_GRACE_S)
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
        return lines, ItemOutcome(reason=_reason(code, err, timed_out) or "error", detail=err, seconds=seconds)

    async def retire(self) -> None:
        """Kill the process (its pipes close with it) and remove its work folder."""
        _kill(self.started.process)
        await self.started.process.wait()
        _remove(self.started.workdir)


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
    _spare: asyncio.Task | None = None
    _idle: dict[str, list[_RewardProcess]] = field(default_factory=dict)
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

    async def _start_reward(self, reward: str, import_timeout_s: float) -> _RewardProcess:
        """A process that imports `reward`'s module within `import_timeout_s` (the answer to a failed import comes
        with the first batch) and then serves batches."""
        path = (
            [_inside_path(p) for p in sys.path]
            if self.capabilities.method == "bwrap"
            else [os.path.abspath(p or ".") for p in sys.path]
        )
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
        started = await self._take()
        started.process.stdin.write(json.dumps(payload).encode() + b"\n")
        return _RewardProcess(started, _Tail(started.process.stderr, self.limits.output_bytes))

    def warm(self) -> None:
        """Start the first process ahead, so that even the first call finds one ready."""
        if self._spare is None:
            self._spare = asyncio.ensure_future(self._start())

    async def close(self) -> None:
        """Stop the pre-started process (one that failed to start has nothing to stop) and the idle reward ones."""
        idle, self._idle = [p for ps in self._idle.values() for p in ps], {}
        for process in idle:
            await self._retire(process)
        if self._spare is not None:
            spare, self._spare = self._spare, None
            try:
                started = await spare
            except ToolInfraError:
                return
            _kill(started.process)
            await started.process.wait()
            _remove(started.workdir)
            self._leased.discard(started.uid)

    async def _retire(self, process: _RewardProcess) -> None:
        await process.retire()
        self._leased.discard(process.started.uid)

    async def _run(self, payload: dict[str, Any], timeout_s: float) -> RunOutcome:
        started = await self._take()
        payload["limits"] = self.limits.rlimits()
        began = time.perf_counter()
        process = started.process
        try:
            process.stdin.write(json.dumps(payload).encode())
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading: its exit status says why
        keep = self.limits.output_bytes
        reading = asyncio.gather(_drain(process.stdout, keep), _drain(process.stderr, keep, tail=True))
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(asyncio.shield(reading), timeout_s)
            await process.wait()
            timed_out = False
        except TimeoutError:
            _kill(process)
            (out, out_cut), (err, err_cut) = await _after_kill(reading, (("", 0), ("", 0)))
            await process.wait()
            timed_out = True
        except BaseException:  # cancelled: the run must not outlive its call (nor keep its uid)
            _kill(process)
            await asyncio.shield(process.wait())
            raise
        finally:
            _remove(started.workdir)
            self._leased.discard(started.uid)
        code = process.returncode
        return RunOutcome(
            out, err, code, _reason(code, err, timed_out), time.perf_counter() - began, process.pid, out_cut + err_cut
        )

    async def _take(self) -> _Started:
        """The spare process (started now if there is none), once it is ready; the next one starts meanwhile."""
        spare = self._spare or asyncio.ensure_future(self._start())
        self._spare = asyncio.ensure_future(self._start())
        return await spare

    async def _start(self) -> _Started:
        began = time.perf_counter()
        uid = self._lease_uid()
        try:
            argv, workdir = self._command(uid)
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir or "/",
                env=_clean_env(workdir), start_new_session=True,
            )  # fmt: skip
            ready = await process.stdout.read(1)
            if ready != READY:
                await process.wait()
                detail = (await process.stderr.read(2000)).decode(errors="replace").strip()
                raise ToolInfraError("sandbox_start_failed", f"exit {process.returncode}: {detail}")
        except BaseException:
            self._leased.discard(uid)
            raise
        self.start_seconds.append(time.perf_counter() - began)
        return _Started(process, began, uid, workdir)

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

    def _command(self, uid: int) -> tuple[list[str], str | None]:
        """argv, and the host work folder of an `rlimits` run (bwrap runs use their own tmpfs)."""
        caps = self.capabilities
        root = os.geteuid() == 0
        if caps.method == "bwrap":
            interpreter = _inside_path(sys._base_executable)
            prefix = _bwrap_prefix(shutil.which("bwrap"), uid if root else None, self.limits.file_bytes)
            return prefix + [interpreter, "-I", "-c", RUNNER], None
        user = uid if caps.uid_dropped else None
        workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        if user is not None:
            os.chown(workdir, user, user)  # 0700: only this run's uid enters it
        return _drop_to(user) + [sys._base_executable, "-I", "-c", RUNNER], workdir


async def _drain(stream: asyncio.StreamReader, keep: int, tail: bool = False) -> tuple[str, int]:
    """Read a stream to its end keeping its first `keep` bytes (its last with `tail`: where a traceback says
    what went wrong); the text and how many bytes were cut."""
    kept, total = bytearray(), 0
    while chunk := await stream.read(65536):
        total += len(chunk)
        kept = (kept + chunk)[-keep:] if tail else kept + chunk[: keep - len(kept)]
    return kept.decode(errors="replace"), total - len(kept)


async def _item_line(stdout: asyncio.StreamReader) -> dict[str, Any] | None:
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


async def _after_kill(reading: Any, empty: Any) -> Any:
    """What a killed run's pipes held; `empty` when a process that left the group (rlimits only) still holds them."""
    try:
        return await asyncio.wait_for(reading, 2.0)
    except TimeoutError:
        return empty


def _reason(code: int | None, stderr: str, timed_out: bool) -> str | None:
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


def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the run's whole session: bwrap's PID namespace then takes every process in it down too."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _clean_env(workdir: str | None) -> dict[str, str]:
    """No variable of the worker's environment (tokens, addresses) reaches the run."""
    home = workdir or "/tmp"
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _remove(workdir: str | None) -> None:
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
