"""Autoscaling and the restart policy with real components (Ray, vLLM CPU engines, one FSDP2 rank, the tiny
model), in one short run: a fast learner waits for data and the autoscaler grows the pool 1 -> 2 engines; the
learner is then made slow (`faults.learner_delay_s`) and finished groups pile up, so it shrinks back 2 -> 1. Each
decision is an `autoscale` pool event, a note in `events.jsonl` and a record of the dashboard's `/api/data`,
which the page reads. Then the last engine is SIGKILLed with no restart budget left: its slot is quarantined,
and the run, now below `rollout.min_healthy_engines`, stops with a checkpoint and names the slot."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.controller.faults import signal_worker
from asyncrl.telemetry.dashboard import Dashboard
from asyncrl.testing import SHORT_CONTEXT

pytestmark = pytest.mark.integration

SLOW_FROM_STEP = 200
"""The learner waits 2.5 s per step from this step on; before it, it trains as fast as it can."""


def _config(out: Path, model_dir: Path):
    overrides = {
        "output_dir": str(out),
        "model.path": str(model_dir),
        "model.preset": "tiny-0.3m",
        "model.warm_start_examples": 0,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": 12,
        "rollout.max_model_len": SHORT_CONTEXT,
        "rollout.max_restarts_per_engine": 0,  # the first death quarantines the slot
        "rollout.autoscale": {
            "min": 1,
            "max": 2,
            "cooldown_s": 4,
            "sustain": 2,
            "grow_learner_idle": 0.2,
            "shrink_learner_idle": 0.1,
        },
        "buffer.max_staleness": 1,
        "buffer.filter_zero_variance": False,
        "algorithm.preset": "grpo",
        "learner.prompts_per_step": 4,
        "learner.max_steps": 400,  # the run ends below the minimum of healthy engines, long before
        "learner.compile": False,
        "data.eval_prompts": 1,
        "eval.every_steps": 0,
        "telemetry.progress": False,
        "telemetry.pool_every_s": 0.5,
        "telemetry.rate_window_s": 3,
        "checkpoint.every_steps": 0,
        "checkpoint.export_hf": False,
        "faults.learner_delay_s": {1: 0.0, SLOW_FROM_STEP: 2.5},
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _records(dashboard: Dashboard) -> list[dict]:
    url = f"{dashboard.url}api/data?since=0"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {dashboard.server.token}"})
    return json.loads(urllib.request.urlopen(request, timeout=10).read())["records"]


def _wait_for(what: str, check, timeout_s: float = 200.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (found := check()) is not None:
            return found
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout_s:g}s")


def test_a_slow_then_fast_learner_scales_real_engines_1_2_1_and_a_quarantined_last_engine_stops_the_run(
    ray_cluster, tiny_model_dir, tmp_path
):
    from asyncrl.controller.loop import Controller

    controller = Controller(_config(tmp_path / "run", tiny_model_dir), tiny_model_dir)
    (dashboard,) = [s for s in controller.telemetry.sinks if isinstance(s, Dashboard)]
    fleet, result = controller.fleet, {}
    controller.start()
    thread = threading.Thread(target=lambda: result.update(summary=controller.run()), daemon=True)
    thread.start()
    try:

        def shrunk():
            kinds = [(e["kind"], e.get("size")) for e in list(fleet.pool_events)]
            return kinds if ("scaled_down", None) in kinds else None

        _wait_for("scale-down after a scale-up", shrunk)
        left = "rollout-0"  # the first engine: the scale-down stopped the newest
        signal_worker(ray_cluster.get(fleet.rollout.handle(left).ready.remote(), timeout=30)["pid"], "kill")
        thread.join(120)
        assert not thread.is_alive(), "the run did not stop after its last engine was quarantined"
    finally:
        controller.request_stop("test over")
        thread.join(120)
        controller.shutdown()
    summary, out = result["summary"], tmp_path / "run"
    for e in summary["pool_events"]:  # the timeline docs/scaling.md quotes (pytest -s)
        print(f"{e['t_s']:7.1f}s step {e['step']:3d} {e['kind']} {e['worker']} {e.get('reason', e.get('detail', ''))}")
    print("scaling:", summary["scaling"], "steps:", summary["steps"], "wall:", summary["wall_clock_s"])

    events = summary["pool_events"]
    decisions = [(e["from_size"], e["size"], e["step"]) for e in events if e["kind"] == "autoscale"]
    assert [d[:2] for d in decisions] == [(1, 2), (2, 1)], decisions
    assert decisions[0][2] < SLOW_FROM_STEP <= decisions[1][2]  # grown while fast, shrunk once slow
    kinds = [e["kind"] for e in events]
    assert kinds.count("scaled_up") == kinds.count("scaled_down") == 1
    grown = next(e["worker"] for e in events if e["kind"] == "scaled_up")
    joined = next(i for i, e in enumerate(events) if e["kind"] == "joined" and e["worker"] == grown)
    assert joined < kinds.index("scaled_down")  # the cool-down counted from the join: no shrink while joining
    assert next(e["worker"] for e in events if e["kind"] == "scaled_down") == grown  # the newest goes first

    # The last engine died with no budget left: quarantined, and the run stopped with a checkpoint naming it.
    assert [(e["kind"], e["worker"]) for e in events if e["kind"] in ("died", "quarantined")] == [
        ("died", left),
        ("quarantined", left),
    ]
    assert summary["stopped_early"] == (
        "0 healthy rollout engine(s) left, below rollout.min_healthy_engines = 1 (quarantined: "
        f"{left}: its restart budget is spent (0 restarts))"
    )
    assert summary["engine_restarts"]["quarantined"] == {left: "its restart budget is spent (0 restarts)"}
    assert (out / "checkpoints" / f"step-{summary['steps']:06d}").is_dir()

    # The decisions as notes: in events.jsonl and in what the page reads.
    wanted = ["autoscale: rollout pool 1 -> 2 (learner idle", "autoscale: rollout pool 2 -> 1 (learner idle"]
    lines = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    for records in ([{"kind": r["kind"], "data": r["data"]} for r in lines], _records(dashboard)):
        notes = [r["data"]["text"] for r in records if r["kind"] == "note"]
        assert [next(n for n in notes if n.startswith(w))[: len(w)] for w in wanted] == wanted
    sizes = [r["data"]["pool/rollout"] for r in _records(dashboard) if r["kind"] == "pool"]
    assert 2 in sizes and sizes[-1] == 0
