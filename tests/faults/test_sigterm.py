"""SIGTERM to `asyncrl run` (what a job scheduler sends, and Ctrl-C alike): the run stops within a bounded
time, writes its summary and a checkpoint, leaves no process behind, and resumes from that checkpoint."""

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


def test_sigterm_checkpoints_writes_the_summary_leaves_nothing_behind_and_resumes(tmp_path):
    marker = f"/tmp/ar-sig-{os.getpid()}"
    env = _env(marker)
    out = tmp_path / "run"
    cmd = [str(BIN / "asyncrl"), "run", f"output_dir={out}", "learner.max_steps=100000", *TINY_RUN]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = out / "metrics.jsonl"
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 300, "two logged steps")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        print(f"exited {time.monotonic() - sent:.1f}s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGTERM received" and summary["steps"] >= 2
    checkpoint = out / "checkpoints" / f"step-{summary['steps']:06d}"
    assert (checkpoint / "learner_state.json").is_file()
    deadline = time.monotonic() + 30  # Ray's processes exit shortly after the driver disconnects
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_env(marker) == []

    resumed = subprocess.run(
        [*cmd[:3], f"learner.max_steps={summary['steps'] + 2}", *TINY_RUN, "checkpoint.resume_from=latest"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = json.loads((out / "summary.json").read_text())
    assert after["steps"] == after["final_version"] == summary["steps"] + 2
    assert after["stopped_early"] is None


def test_a_killed_driver_resumes_from_its_last_checkpoint_with_the_same_version_and_counters(tmp_path):
    marker = f"/tmp/ar-kill-{os.getpid()}"
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

    resumed = subprocess.run([*cmd, f"learner.max_steps={extra['step'] + 2}", "checkpoint.resume_from=latest"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = json.loads((out / "summary.json").read_text())
    assert after["steps"] == after["final_version"] == extra["step"] + 2 == extra["version"] + 2
    assert after["samples_trained"] == extra["samples_trained"] + 2 * 4 * 2  # 4 groups of 2 per step, none filtered
    c = after["counters"]
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    assert c["dispatched"] == ended
