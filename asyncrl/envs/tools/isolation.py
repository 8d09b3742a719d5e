"""Isolation of a sandboxed run: what this machine gives (`detect_capabilities`), the command prefix that
confines a run (bubblewrap's namespaces and mounts, a uid drop with `setpriv`), the environment it starts with,
the machine-wide lease of unprivileged uids, and the runner file every sandboxed uid can read.

See `sandbox.py` for how a run uses them, docs/tools.md for what each isolation gives.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.envs.tools import runner
from asyncrl.envs.tools.base import ToolInfraError
from asyncrl.envs.tools.mounts import SYSTEM_DIRS, system_binds

__all__ = [
    "Capabilities",
    "base_python",
    "bwrap_prefix",
    "clean_env",
    "detect_capabilities",
    "drop_to",
    "lease_uid_block",
    "staged_runner",
]

RUNNER_MOUNT = "/run/asyncrl-sandbox-runner.py"
"""Where the runner file is mounted inside a bwrap sandbox (its `/tmp` is the run's own)."""
RUNNER_DIR = Path(tempfile.gettempdir()) / f"asyncrl-sandbox-runner-{os.geteuid()}"
"""Where the runner is copied for every sandboxed uid to read (`staged_runner`): the package itself may sit in
a folder they cannot enter."""
UIDS_PER_SANDBOX = 64
"""The uids one sandbox (one tool worker) gives its live processes, one each (`Sandbox._lease_uid`): running
programs, kept reward processes and the spare. RLIMIT_NPROC counts per uid."""
UID_LOCKS = Path(tempfile.gettempdir()) / "asyncrl-sandbox-uids"
"""One lock file per leased block of uids on this machine (`lease_uid_block`)."""
UID_BLOCKS = 1024
"""How many blocks from `tools.sandbox_uid_base` a tool worker tries before it gives up."""


@dataclass(frozen=True)
class Capabilities:
    """What isolation this machine gives a sandboxed run (logged once per tool worker, shown by `asyncrl check`)."""

    method: str
    """`bwrap` (namespaces + limits) or `rlimits` (resource limits only)."""
    network_isolated: bool
    pid_namespace: bool
    host_hidden: bool
    """The run sees none of the host's files but the system's programs and libraries (`mounts.SYSTEM_DIRS`), the
    interpreter's installation and what its tool mounts, all read-only: no home, checkout, run folder or dataset."""
    private_tmp: bool
    """The run's writable directory is invisible to every other run."""
    uid_dropped: bool
    nproc_enforced: bool
    """RLIMIT_NPROC holds (it does not for uid 0)."""
    detail: str = ""

    def __str__(self) -> str:
        flags = ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in asdict(self).items() if isinstance(v, bool))
        return f"sandbox: {self.method} ({flags}){': ' + self.detail if self.detail else ''}"


@functools.lru_cache(maxsize=1)
def detect_capabilities() -> Capabilities:
    """Probe once: run a trivial command under bwrap and see whether the namespaces come up."""
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if bwrap:
        probe = subprocess.run(bwrap_prefix(bwrap, None, 1 << 20) + ["true"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return Capabilities("bwrap", True, True, True, True, uid_dropped=root, nproc_enforced=True)
        reason = f"bwrap is installed but failed: {probe.stderr.decode(errors='replace').strip()[:200]}"
    else:
        reason = "bwrap not found (Debian package `bubblewrap`)"
    can_drop = root and _nobody_can_run_python()
    return Capabilities(
        "rlimits", False, False, False, private_tmp=can_drop, uid_dropped=can_drop, nproc_enforced=can_drop or not root,
        detail=reason + "; no network, PID or filesystem isolation: a run reads every file its uid may read",
    )  # fmt: skip


def _nobody_can_run_python() -> bool:
    """Whether an unprivileged uid can start this interpreter in place (its prefix is world-readable)."""
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in _parents(base_python()))


def base_python() -> str:
    """The interpreter outside any virtual environment (a sandboxed run starts it with `-I`): CPython's
    `sys._base_executable`, which the standard library does not declare."""
    return str(getattr(sys, "_base_executable", sys.executable))


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


def bwrap_prefix(
    bwrap: str,
    uid: int | None,
    tmp_bytes: int,
    runner: str | None = None,
    binds: Sequence[str] = (),
    hide: Sequence[str] = (),
) -> list[str]:
    """bwrap's arguments: an empty root holding only the system's programs and libraries (`system_binds`),
    `/dev`, `/proc`, an empty `/run`, its own `/tmp`, the interpreter's installation and the host paths `binds`
    (read-only, each at its own place: the interpreter finds its shared library where it was built), and
    every namespace but the user's (we may be root); `setpriv` then drops to `uid` with no capabilities.
    `runner`: the host file mounted at `RUNNER_MOUNT`; `hide`: folders of those shown empty instead."""
    args = [
        bwrap, *system_binds(), "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/run",
        "--perms", "01777", "--size", str(tmp_bytes), "--tmpfs", "/tmp", *_host_binds([sys.base_prefix, *binds]),
        *(["--ro-bind", runner, RUNNER_MOUNT] if runner else []),
        *(arg for p in hide if os.path.isdir(p) for arg in ("--tmpfs", p)),
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--new-session", "--chdir", "/tmp",
    ]  # fmt: skip
    return args + drop_to(uid)


def _host_binds(paths: Sequence[str]) -> list[str]:
    """Read-only binds of `paths` at their own place (one inside another is bound with it), after their missing
    parent folders, made enterable by every uid (bwrap would make them 0700)."""
    real = {os.path.realpath(p) for p in paths}
    kept = sorted(p for p in real if not any(p.startswith(q + os.sep) for q in real))
    inside = ("/dev", "/proc", *SYSTEM_DIRS, *kept)  # folders whose content is the host's (or the kernel's)
    parents = sorted(
        {
            parent
            for p in kept
            for parent in _parents(p)[1:]
            if parent not in ("/tmp", "/run") and not any(parent == m or parent.startswith(m + os.sep) for m in inside)
        }
    )
    return [
        *(arg for d in parents for arg in ("--perms", "0755", "--dir", d)),
        *(a for p in kept for a in ("--ro-bind", p, p)),
    ]


def drop_to(uid: int | None) -> list[str]:
    """The command prefix that runs the rest as `uid`, without groups or capabilities (none for None)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]


def clean_env(workdir: str | None) -> dict[str, str]:
    """No variable of the worker's environment (tokens, addresses) reaches the run."""
    home = workdir or "/tmp"
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def staged_runner() -> str:
    """The path of a copy of `runner.py` that every sandboxed uid can read: a file named by its content's hash in
    a folder of this user's, written once per machine and version (concurrent tool workers agree on it)."""
    source, name = _runner_source()
    RUNNER_DIR.mkdir(mode=0o755, exist_ok=True)
    info = os.lstat(RUNNER_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ToolInfraError("sandbox_runner", f"{RUNNER_DIR} must be a directory of this uid, writable only by it")
    path = RUNNER_DIR / name
    if not path.exists():
        os.chmod(RUNNER_DIR, 0o755)  # whatever the umask: every sandboxed uid enters it
        partial = path.with_name(f"{name}.{os.getpid()}")
        partial.write_bytes(source)
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    return str(path)


@functools.lru_cache(maxsize=1)
def _runner_source() -> tuple[bytes, str]:
    source = Path(runner.__file__).read_bytes()
    return source, f"runner-{hashlib.sha256(source).hexdigest()[:16]}.py"
