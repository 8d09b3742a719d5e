"""`learner.cpu_nice`: `rank.lower_priority` sets every thread of the process, and threads started later inherit it."""

import os
import threading

import pytest

from asyncrl.config import load_config
from asyncrl.learner.rank import lower_priority


def _in_child(nice: int) -> list[int]:
    """Niceness of a thread started before `lower_priority(nice)`, of the calling thread, and of one started after, in a
    forked child (a niceness never goes back down without privileges, so not in the test process)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        seen, go = [], threading.Event()
        before = threading.Thread(target=lambda: (go.wait(), seen.append(os.getpriority(os.PRIO_PROCESS, 0))))
        before.start()
        lower_priority(nice)
        go.set()
        before.join()
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))
        after = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
        after.start()
        after.join()
        os.write(write, bytes(seen))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return list(f.read())


def test_lower_priority_sets_every_thread_and_the_threads_started_after():
    start = os.getpriority(os.PRIO_PROCESS, 0)
    assert _in_child(start + 7) == [start + 7] * 3
    assert _in_child(max(0, start - 1)) == [start] * 3  # never raised back


@pytest.mark.parametrize("bad", ["-1", "20"])
def test_cpu_nice_defaults_off_and_is_bounded(bad):
    assert load_config(None, []).learner.cpu_nice == 0
    with pytest.raises(Exception, match="cpu_nice"):
        load_config(None, [f"learner.cpu_nice={bad}"])
