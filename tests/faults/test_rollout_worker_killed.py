"""Real faults in one live run (one engine start shared by the module):

- a rollout worker's process is SIGKILLed while its engine loads new weights: the run goes on, the dead worker
  is noticed and replaced, its requests are re-dispatched, and nothing is lost or trained twice (checked from the
  queue's counters and from trajectories.parquet);
- chaos: one more SIGKILL and one SIGSTOP (the worker and its engine core) of the serving engine, at seeded
  random steps (the kill hits the engine the run started with, so the injected kill above hits a replacement):
  the hung engine is found by the heartbeat and replaced, every step still runs, each replacement counts against
  the slot's restart budget, and the stopped processes do not outlive the run;
- a NaN reaches the learner (a NaN reward, so NaN advantages, loss and gradient): the step is skipped and
  counted, its batch kept, and the weights stay finite.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from asyncrl.config import load_config
from asyncrl.testing import TINY_RUN

pytestmark = pytest.mark.integration

STEPS = 10  # room for three engine outages (steps 2, 3 and 6): a fault waits while no engine serves
KILL_AT = [3]
NAN_AT = 5
HEARTBEAT_S = 10


@pytest.fixture(scope="module")
def run_dir(ray_cluster, tmp_path_factory):
    from asyncrl.controller import run

    out = tmp_path_factory.mktemp("faults") / "run"
    cfg = load_config(None, [
        f"output_dir={out}", f"learner.max_steps={STEPS}", *TINY_RUN,
        "weight_sync.parity_probe=false",  # the probe would wait for the sync the fault interrupts
        f"faults.kill_rollout_worker_at_steps={KILL_AT}", f"faults.nan_reward_at_steps=[{NAN_AT}]",
        "faults.chaos.kills=1", "faults.chaos.stops=1", "faults.chaos.seed=0",  # a kill at step 2, a stop at 6
        "faults.chaos.first_step=2", "faults.chaos.last_step=8",
        f"rollout.heartbeat_timeout_s={HEARTBEAT_S}",
        "rollout.quarantine_failures=5",  # three failures of the one slot: within the budget, not a crash loop
    ])
    run(cfg)
    return out


def test_the_run_finishes_every_step_after_two_engine_deaths(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    faults = summary["faults"]
    assert len(faults) == len(KILL_AT) and all(f["step"] >= at for f, at in zip(faults, KILL_AT, strict=True))
    assert [e["kind"] for e in summary["pool_events"]].count("chaos_kill") == 1  # the second death
    # The killed workers' last reported counters stay in the run's totals; no serving worker is among them.
    chaos = {e["worker"] for e in summary["pool_events"] if e["kind"].startswith("chaos_")}
    assert set(summary["rollout_retired"]) <= {f["worker"] for f in faults} | chaos and not set(summary["rollout_retired"]) & set(summary["rollout"])
    for fault in faults:
        print(f"killed {fault['worker']} after step {fault['step']}: detected {fault['detected_s']}s, serving again {fault['recovered_s']}s")
        assert fault["detected_s"] is not None and fault["detected_s"] < 15  # noticed by the pool, not a batch timeout
        assert fault["recovered_s"] is not None


def test_chaos_kills_and_stops_are_replaced_within_the_slots_budget_and_leave_no_process(run_dir):
    import psutil

    summary = json.loads((run_dir / "summary.json").read_text())
    events = summary["pool_events"]
    chaos = [e for e in events if e["kind"].startswith("chaos_")]
    assert sorted(e["kind"] for e in chaos) == ["chaos_kill", "chaos_stop"]
    for fault in chaos:
        expected = "died" if fault["kind"] == "chaos_kill" else "hung"
        (seen,) = [e for e in events if e["worker"] == fault["worker"] and e["kind"] in ("died", "hung")]
        assert seen["kind"] == expected and seen["replacement"] is not None
        print(f"{fault['kind']} of {fault['worker']} at step {fault['step']}: {expected} after {seen['t_s'] - fault['t_s']:.1f}s")
        if expected == "hung":
            assert seen["t_s"] - fault["t_s"] < HEARTBEAT_S + 15
    assert summary["engine_restarts"] == {"restarts": {"rollout-0": 3}, "quarantined": {}}  # one slot: a kill + chaos
    stopped = next(e for e in chaos if e["kind"] == "chaos_stop")["pids"]
    assert len(stopped) >= 2 and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in stopped)


def test_a_replacement_serves_at_least_the_weights_published_when_its_predecessor_died(run_dir):
    events = json.loads((run_dir / "summary.json").read_text())["pool_events"]
    for died in (e for e in events if e["kind"] == "died"):
        joined = next(e for e in events if e["kind"] == "joined" and e["worker"] == died["replacement"])
        assert joined["version"] >= died["step"]  # version k is published right after step k


def test_conservation_holds_exactly_and_no_sample_is_trained_twice(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    c = summary["counters"]
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    assert c["dispatched"] == ended
    assert c["requeued"] >= 1  # the killed workers held requests, and they were handed out again

    log = pq.read_table(run_dir / "trajectories.parquet").to_pylist()
    trained = [(r["group_id"], r["sample_index"]) for r in log if r["fate"] == "trained"]
    assert len(trained) == len(set(trained)) == c["trained"] == summary["samples_trained"]


def test_a_non_finite_step_is_skipped_counted_and_kept_and_the_weights_stay_finite(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert summary["skipped_steps"] == 1 and rows[NAN_AT]["skipped_step"] == 1
    assert not any(r["skipped_step"] for s, r in rows.items() if s != NAN_AT)
    bad = pq.read_table(run_dir / "bad_batches" / f"step-{NAN_AT:06d}.parquet").to_pylist()
    assert len(bad) == 8 and np.isnan(bad[0]["reward"])  # the offending sample, kept for inspection
    weights = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert all(np.isfinite(w).all() for w in weights.values())
