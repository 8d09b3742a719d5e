"""`asyncrl submit/status/logs/stop` against a real Ray head started by `ray start` (dashboard + Jobs API).

The head binds 127.0.0.1 and gets its own ports and temp dir, so it never meets the Ray sessions that other
test modules start with `ray.init`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from asyncrl.testing import TINY_RUN, free_port, kill_processes_with_env, ray_node_ports

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A one-node cluster with the dashboard; yields its Jobs API address."""
    dashboard = f"http://127.0.0.1:{(dash_port := free_port())}"
    temp = Path("/tmp") / f"ray-jobs-{os.getpid()}"  # short: Ray's socket paths have a length limit
    # Jobs find this venv's `asyncrl`; every process of this cluster inherits the marker (teardown kills by it).
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ASYNCRL_TEST_CLUSTER=str(temp))
    start = [
        str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
        "--num-cpus=4", f"--temp-dir={temp}", "--disable-usage-stats", *ray_node_ports(),
    ]
    subprocess.run(start, check=True, env=env, capture_output=True, text=True, timeout=180)
    try:
        yield dashboard, env
    finally:
        kill_processes_with_env(f"ASYNCRL_TEST_CLUSTER={temp}")  # never `ray stop`: it kills every Ray on the machine


def _cli(args: list[str], env: dict, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "asyncrl"), *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_submit_runs_a_short_job_to_completion_and_status_and_logs_read_it_back(head, tmp_path):
    address, env = head
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "learner.max_steps=2", *TINY_RUN]
    done = _cli(["submit", *overrides, "--address", address, "--working-dir", "", "--job-id", "asyncrl-test-1"], env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "submitted asyncrl-test-1" in done.stdout and "asyncrl-test-1 SUCCEEDED" in done.stdout
    assert (out / "summary.json").exists() and '"steps": 2' in (out / "summary.json").read_text()

    status = _cli(["status", "--address", address], env)
    assert status.returncode == 0 and "asyncrl-test-1  SUCCEEDED  asyncrl run --config-env ASYNCRL_JOB_CONFIG" in status.stdout
    logs = _cli(["logs", "asyncrl-test-1", "--address", address], env)
    assert logs.returncode == 0 and '"final_version": 2' in logs.stdout


def test_scale_grows_and_shrinks_both_pools_of_a_running_job_and_stop_ends_it_with_a_checkpoint(head, tmp_path):
    """rollout 1 -> 2 -> 1 and learner 1 -> 2 -> 1 ranks in one running job (the learner re-formed in the same
    driver from a checkpoint, re-sharded); every step runs once and nothing is trained twice."""
    address, env = head
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "learner.max_steps=100000", *TINY_RUN]
    done = _cli(["submit", *overrides, "--address", address, "--working-dir", "", "--job-id", "asyncrl-scale", "--no-wait"], env)
    assert done.returncode == 0, done.stderr
    metrics, events = out / "metrics.jsonl", out / "events.jsonl"

    def logs() -> str:  # read through the Jobs API only on a timeout: each call starts a process (~1 s of CPU)
        return _cli(["logs", "asyncrl-scale", "--address", address], env).stdout

    def noted(text: str) -> bool:
        return events.exists() and text in events.read_text()

    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 300, "three steps", logs)
    up = _cli(["scale", "asyncrl-scale", "rollout=2", "--address", address], env)
    assert up.returncode == 0 and "rollout pool -> 2 workers" in up.stdout, up.stdout + up.stderr
    _wait_for(lambda: noted("rollout worker rollout-1 serves version"), 300, "rollout-1 to serve", logs)
    both = _cli(["scale", "asyncrl-scale", "rollout=1", "learner=2", "--address", address], env)
    assert both.returncode == 0 and "learner pool -> 2 ranks" in both.stdout, both.stdout + both.stderr
    _wait_for(lambda: noted("scaling the rollout pool 2 -> 1"), 120, "the scale-down", logs)
    _wait_for(lambda: noted("first step on the re-formed learner pool (2 ranks)"), 300, "a step on 2 ranks", logs)
    down = _cli(["scale", "asyncrl-scale", "learner=1", "--address", address], env)
    assert down.returncode == 0, down.stdout + down.stderr
    _wait_for(lambda: noted("first step on the re-formed learner pool (1 ranks)"), 300, "a step on 1 rank", logs)
    assert "stop requested" in _cli(["stop", "asyncrl-scale", "--address", address], env).stdout
    _wait_for(lambda: (out / "summary.json").exists(), 300, "the stopped job's summary", logs)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGTERM received"  # never restarted: one run from start to stop
    assert (out / "checkpoints" / f"step-{summary['steps']:06d}" / "learner_state.json").is_file()
    kinds = [(e["kind"], e["worker"]) for e in summary["pool_events"]]
    assert ("scaled_up", "rollout-1") in kinds and ("joined", "rollout-1") in kinds
    assert ("scaled_down", "rollout-1") in kinds and not any(k == "died" for k, _ in kinds)
    (scaling,) = summary["scaling"]
    assert scaling["joined_version"] >= scaling["requested_at_version"]  # current weights before its first request
    print(f"scale-up: request -> serving {scaling['request_to_serving_s']}s")
    grow, shrink = summary["learner_scaling"]
    assert (grow["from_ranks"], grow["ranks"], shrink["from_ranks"], shrink["ranks"]) == (1, 2, 2, 1)
    assert grow["version"] == grow["step"] and shrink["version"] == shrink["step"]  # it went on at the same version
    for resize in (grow, shrink):
        assert (out / "checkpoints" / f"step-{resize['step']:06d}" / "learner_state.json").is_file()
        print(f"learner {resize['from_ranks']} -> {resize['ranks']}: request -> first step {resize['request_to_first_step_s']}s "
              f"(checkpoint {resize['checkpoint_s']}s, re-form {resize['reform_s']}s)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))  # every step ran, once
    assert summary["final_version"] == summary["steps"]
    c = summary["counters"]
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    assert c["dispatched"] == ended
    _wait_for(lambda: noted('"kind": "close"'), 120, "the job's pools to stop", logs)  # the log's footer is written
    log = pq.read_table(out / "trajectories.parquet", columns=["group_id", "sample_index", "fate"]).to_pylist()
    trained = [(r["group_id"], r["sample_index"]) for r in log if r["fate"] == "trained"]
    assert len(trained) == len(set(trained)) == c["trained"] == summary["samples_trained"] == summary["steps"] * 4 * 2


def _wait_for(predicate, timeout_s: float, what: str, logs=None) -> None:
    """Poll `predicate` each second; on a timeout the message ends with the job's last log lines (`logs()`)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tail = "\n".join(logs().splitlines()[-200:]) if logs else ""
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}\n{tail}")
        time.sleep(1)


def test_a_config_error_is_reported_before_anything_is_submitted(head):
    address, env = head
    done = _cli(["submit", "learner.lrr=3", "--address", address], env)
    assert done.returncode == 2 and "learner.lrr" in done.stderr and "submitted" not in done.stdout
