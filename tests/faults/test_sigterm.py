"""SIGKILL and SIGTERM to `asyncrl run`. A killed driver resumes from its last checkpoint with the same
version and counters. SIGTERM (what a job scheduler sends, and Ctrl-C alike) stops the run within a bounded
time; it writes its summary and a checkpoint, leaves no process behind, and resumes from that checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.testing import TINY_RUN, kill_processes_with_env, processes_with_env

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def _env(marker: str) -> dict[str, str]:
    """A local run whose every process (Ray's included) carries `marker` in its environment."""
    env = dict(os.environ, RAY_TMPDIR=marker, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.5)
    return value


def test_a_killed_driver_resumes_then_a_sigterm_checkpoints_leaves_nothing_behind_and_resumes_again(tmp_path):
    """One run through both ends a scheduler gives a job (three `asyncrl run`s instead of four): SIGKILL at
    any point, resumed from the last checkpoint; then SIGTERM, which stops at a step boundary with a summary
    and a checkpoint; then a resume from that one."""
    marker = f"/tmp/ar-sig-{os.getpid()}"
    env = _env(marker)
    out = tmp_path / "run"
    cmd = [str(BIN / "asyncrl"), "run", f"output_dir={out}", "checkpoint.every_steps=2", *TINY_RUN]
    proc = subprocess.Popen([*cmd, "learner.max_steps=100000"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: (out / "checkpoints" / "step-000004" / "learner_state.json").is_file(), 300, "the step-4 checkpoint")
    finally:
        proc.kill()  # SIGKILL: no cleanup, no summary, whatever step it was in
        proc.wait()
    kill_processes_with_env(marker)  # what the crash left behind (a real crash leaves them to the node)
    saved = max(f for f in (out / "checkpoints").iterdir() if (f / "learner_state.json").is_file())
    extra = json.loads((saved / "extra.json").read_text())
    assert not (out / "summary.json").exists()

    summary = _resume_then_sigterm(cmd, env, out, extra["step"] + 2)
    assert summary["stopped_early"] == "SIGTERM received" and summary["steps"] >= extra["step"] + 2
    assert summary["final_version"] == summary["steps"]  # the version went on from the killed run's checkpoint
    assert summary["samples_trained"] == extra["samples_trained"] + (summary["steps"] - extra["step"]) * 4 * 2  # 4 groups of 2
    _assert_conserved(summary["counters"])
    assert (out / "checkpoints" / f"step-{summary['steps']:06d}" / "learner_state.json").is_file()
    deadline = time.monotonic() + 30  # Ray's processes exit shortly after the driver disconnects
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_env(marker) == []

    resumed = subprocess.run([*cmd, f"learner.max_steps={summary['steps'] + 2}", "checkpoint.resume_from=latest"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = json.loads((out / "summary.json").read_text())
    assert after["steps"] == after["final_version"] == summary["steps"] + 2
    assert after["samples_trained"] == summary["samples_trained"] + 2 * 4 * 2 and after["stopped_early"] is None
    _assert_conserved(after["counters"])


def _resume_then_sigterm(cmd: list[str], env: dict, out: Path, checkpoint_step: int) -> dict:
    """Resume the run from its latest checkpoint, SIGTERM it once it checkpointed `checkpoint_step`; -> its summary."""
    proc = subprocess.Popen([*cmd, "learner.max_steps=100000", "checkpoint.resume_from=latest"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: (out / "checkpoints" / f"step-{checkpoint_step:06d}" / "learner_state.json").is_file(), 300, f"the step-{checkpoint_step} checkpoint")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        print(f"exited {time.monotonic() - sent:.1f}s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "summary.json").read_text())


def _assert_conserved(c: dict) -> None:
    """Every dispatched trajectory ended one way or is still in flight."""
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    assert c["dispatched"] == ended
