"""The console view: a live view that redraws in place on a terminal (checked in a real pseudo-terminal),
plain lines everywhere else."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

from asyncrl.telemetry.progress import Progress, ProgressState, step_text

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _row(step: int) -> dict:
    return {"step": step, "version": step, "reward": 0.1 * step, "loss": 0.5, "staleness_mean": 0.5, "staleness_max": 1,
            "mismatch_k3_kl": 2e-4, "tokens": 100, "wall_s": 2.0 * step}  # fmt: skip


# Three steps 0.6 s apart, each after the live view had time to redraw (it refreshes four times a second).
CHILD = """
import time
from asyncrl.telemetry.progress import Progress
from tests.unit.telemetry.test_progress import _row
p = Progress(max_steps=3)
p.phase("starting the learner")
time.sleep(0.6)
for step in (1, 2, 3):
    p.step(_row(step))
    time.sleep(0.6)
p.close({})
"""


def _read_all(fd: int, proc: subprocess.Popen) -> str:
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode(errors="replace")


def test_on_a_terminal_the_live_view_redraws_as_the_step_advances():
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "250", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=follower, stderr=subprocess.STDOUT, env=env)
    os.close(follower)
    raw = _read_all(leader, proc)
    assert proc.wait(30) == 0, raw
    assert "\x1b[" in raw  # cursor movements: it redraws in place rather than printing lines
    text = ANSI.sub("", raw)
    seen = [int(m) for m in re.findall(r"step +(\d)/3", text)]
    assert seen and seen == sorted(seen) and {1, 2, 3} <= set(seen), text
    assert "starting the learner" in text and "ETA" in text


def test_off_a_terminal_each_step_phase_and_eval_is_one_plain_line():
    out = io.StringIO()
    p = Progress(stream=out, max_steps=4, every_steps=2)
    p.phase("starting the replay queue")
    for step in (1, 2):
        p.step(_row(step))
    p.eval({"version": 2, "accuracy": 0.375, "samples_trained": 64})
    p.close({})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\x1b" not in out.getvalue()
    assert lines[0].endswith("starting the replay queue")
    assert "step    2/4  v2" in lines[1] and "reward 0.200" in lines[1]  # step 1 is not a multiple of every_steps
    assert lines[2].endswith("eval  v2    held-out accuracy 0.375 after 64 samples")


def test_step_text_rates_and_eta_are_from_the_run_so_far():
    state = ProgressState(max_steps=10, row=_row(4), accuracy=0.5, tokens_trained=400, generated_per_s=1500.0)
    text = step_text(state)
    assert "heldout 0.500" in text and "mismatch k3 2.0e-04" in text
    assert "tok/s 50 trained 1.5k generated" in text  # 400 tokens / 8 s
    assert "ETA 0m12s" in text  # 6 steps left at 2 s a step


def test_a_resumed_runs_eta_counts_only_the_steps_this_process_made():
    # Resumed after step 2: steps 3 and 4 took this process's 8 s, 4 s each; 6 steps left.
    state = ProgressState(max_steps=10, row=_row(4), accuracy=0.5, tokens_trained=400, steps_before=2)
    assert "ETA 0m24s" in step_text(state)
