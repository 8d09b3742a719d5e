"""The program that runs inside the sandbox (`sandbox.Sandbox`), started as a file by an isolated interpreter
(`python -I runner.py`): it imports nothing but the standard library, and nothing of asyncrl, which the
sandbox cannot import.

It writes one byte (`READY`) once it waits, reads one JSON line (the payload), sets the resource limits, then
runs the program, or serves the rewards: the user's module is imported once, then each line on stdin is a batch
of calls, each run under its own wall (ITIMER_REAL) and CPU (ITIMER_PROF) timers; one JSON line per call goes
to stdout, the reward's prints to stderr. Exit status `MEMORY_EXIT` means the code raised MemoryError.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import IO, Any

READY = b"R"
MEMORY_EXIT = 3
PR_SET_PDEATHSIG = 1


class Limit(BaseException):
    """A call's wall or CPU timer fired (`timeout` or `cpu_time`): not catchable by the reward's `except Exception`."""


def on_limit(signum: int, frame: FrameType | None) -> None:
    raise Limit("timeout" if signum == signal.SIGALRM else "cpu_time")


def last_line(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip()[-300:]


def score(fn: Callable[..., Any], item: dict[str, Any], cpu_s: float, out: IO[str]) -> None:
    """Call the reward on one item under its timers; write its answer line."""
    began = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, item["timeout_s"])
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    line: dict[str, Any]
    try:
        value = fn(
            item["response"], item["ground_truth"], finish_reason=item["finish_reason"], extra_info=item["extra_info"]
        )
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


def serve_rewards(payload: dict[str, Any]) -> None:
    """Import the reward within `import_timeout_s`, then score every batch read from stdin until it closes."""
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
            score(fn, item, payload["cpu_s"], out)


def main() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a kept reward process dies with its tool worker
    os.write(1, READY)
    payload = json.loads(sys.stdin.buffer.readline())
    for name, value in payload["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    try:
        if payload["kind"] == "program":
            exec(compile(payload["source"], "<program>", "exec"), {"__name__": "__main__"})
        else:
            serve_rewards(payload)
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(MEMORY_EXIT)
    except SystemExit as e:
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)  # user's frames
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
