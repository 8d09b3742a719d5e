"""vLLM's own error when its engine dies at start (checked with vLLM 0.32.0).

An engine core that fails to initialise logs its traceback from its own process and the engine raises
`EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.` The engine
core inherits this process's stdout and stderr, which Ray sends to the worker's log files, so "above" is a
file the user of a run never sees. `mark_output` notes where those files end before the engine starts;
`start_failure_cause` reads what was written since and picks the last exception that is not the
`EngineDeadError` itself (e.g. `RuntimeError: Unsupported CPU attention configuration: head_dim=16`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager

OUTPUT_FDS = (1, 2)
TAIL_BYTES = 256 * 1024
"""At most this much of each file is read back (the traceback is at its end)."""

_EXCEPTION = re.compile(r"(?:^|[\s\]])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
"""An exception line, alone or behind a logging prefix (vLLM prefixes every line of a traceback it logs)."""
_NOT_THE_CAUSE = ("EngineDeadError", "See stack trace", "Engine core initialization failed")


def mark_output() -> dict[int, int]:
    """The sizes of this process's stdout and stderr where they are plain files (under Ray they are the
    worker's log files); a pipe or a terminal cannot be read back and is left out."""
    marks = {}
    for fd in OUTPUT_FDS:
        try:
            info = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            marks[fd] = info.st_size
    return marks


def output_since(marks: dict[int, int], max_bytes: int = TAIL_BYTES) -> str:
    """What this process (and its children) wrote to the marked files since `mark_output`. The files are read
    through /proc (Linux): the descriptors themselves are open for writing only."""
    texts = []
    for fd, start in marks.items():
        try:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(start, end - max_bytes))
                texts.append(f.read().decode("utf-8", errors="replace"))
        except OSError:
            continue
    return "\n".join(texts)


def root_cause(text: str) -> str | None:
    """The last exception line of `text` that is not vLLM's "see above" (`EngineDeadError` and its kin)."""
    for line in reversed(text.splitlines()):
        match = _EXCEPTION.search(line.rstrip())
        if match and not any(marker in line for marker in _NOT_THE_CAUSE):
            return f"{match.group(1)}: {match.group(2)}"
    return None


def start_failure_cause(marks: dict[int, int]) -> str | None:
    """The engine's own error, from what was written since `marks`; None when nothing names one."""
    return root_cause(output_since(marks))


class EngineStartError(RuntimeError):
    """The vLLM engine died while starting; the message ends with vLLM's own error (e.g. a head size its CPU
    attention does not serve), which vLLM itself only prints to the engine core's output."""


@contextmanager
def start_failures_explained() -> Iterator[None]:
    """Around an engine's start: a failure whose message lacks vLLM's own error is raised again as
    `EngineStartError` carrying it, read back from the output the engine core shares with this process."""
    marks = mark_output()
    try:
        yield
    except Exception as e:
        cause = start_failure_cause(marks)
        if cause is None or cause in str(e):
            raise
        raise EngineStartError(f"{type(e).__name__}: {e} — the engine's own error: {cause}") from e
