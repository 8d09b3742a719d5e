"""A rollout engine that hangs in a live run: its worker's process and the engine-core processes under it get
SIGSTOP (alive, not answering, exactly what a deadlock looks like from outside). The pool's heartbeat finds it
within `rollout.heartbeat_timeout_s`, kills it and replaces it, its requests are re-dispatched, and the run
finishes every step with nothing lost or trained twice."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.testing import TINY_RUN

pytestmark = pytest.mark.integration

STEPS = 6
STOP_AFTER_STEP = 2
HEARTBEAT_S = 10


def _rollout_worker_processes() -> list[psutil.Process]:
    """This test's rollout worker actor (by its Ray process title) and every process under it (engine core)."""
    mine = psutil.Process().children(recursive=True)
    workers = [p for p in mine if "NodeLocalRolloutWorker" in " ".join(p.cmdline())]
    return [q for p in workers for q in (p, *p.children(recursive=True))]


def _stop_after_rows(out, rows: int, stopped: dict) -> None:
    """Once `rows` step rows are logged, SIGSTOP the serving engine's processes; note when and which."""
    deadline = time.monotonic() + 600
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            break
        time.sleep(0.2)
    processes = _rollout_worker_processes()
    stopped["wall"] = time.time()
    for p in processes:
        os.kill(p.pid, signal.SIGSTOP)
    stopped["pids"] = [p.pid for p in processes]


@pytest.fixture(scope="module")
def hung_run(ray_cluster, tmp_path_factory):
    from asyncrl.controller import run

    out = tmp_path_factory.mktemp("hung") / "run"
    cfg = load_config(None, [
        f"output_dir={out}", f"learner.max_steps={STEPS}", *TINY_RUN,
        "weight_sync.parity_probe=false", f"rollout.heartbeat_timeout_s={HEARTBEAT_S}",
    ])  # fmt: skip
    stopped: dict = {}
    stopper = threading.Thread(target=_stop_after_rows, args=(out, STOP_AFTER_STEP, stopped), daemon=True)
    stopper.start()
    try:
        summary = run(cfg)
    finally:
        stopper.join(timeout=5)
        for pid in stopped.get("pids", []):  # nothing stopped may outlive the test
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    return summary, stopped


def test_a_hung_engine_is_replaced_within_the_heartbeat_timeout_and_the_run_finishes_every_step(hung_run):
    summary, stopped = hung_run
    assert len(stopped["pids"]) >= 2, "the worker and its engine core(s) were stopped"
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    events = summary["pool_events"]
    (hung,) = [e for e in events if e["kind"] == "hung"]
    assert not any(e["kind"] == "died" for e in events)
    joined = next(e for e in events if e["kind"] == "joined" and e["worker"] == hung["replacement"])
    detected_s, serving_s = hung["wall"] - stopped["wall"], joined["wall"] - stopped["wall"]
    print(f"SIGSTOP of {hung['worker']}: killed as hung after {detected_s:.1f}s, ", end="")
    print(f"{joined['worker']} serving after {serving_s:.1f}s")
    # A heartbeat's timeout and a loop turn or two (a batch wait, a snapshot that gives up on the silent worker),
    # not a weight sync's (120 s) or a batch wait's (240 s) timeout.
    assert 0 < detected_s < HEARTBEAT_S + 15
    assert joined["version"] >= hung["step"]


def test_the_hung_engines_requests_are_re_dispatched_and_none_is_lost(hung_run):
    c = hung_run[0]["counters"]
    ended = (
        c["trained"]
        + c["dropped_stale"]
        + c["in_flight"]
        + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    )
    assert c["dispatched"] == ended
    # What the hung engine held when it stopped was handed out again, and nothing else was: how much it held
    # depends on where its generation stood (an engine held back by the ready lead holds none).
    (hung,) = [e for e in hung_run[0]["pool_events"] if e["kind"] == "hung"]
    assert c["requeued"] == hung["requeued"]
    assert c["trained"] == hung_run[0]["samples_trained"]
