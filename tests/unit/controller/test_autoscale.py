"""The rollout autoscaler's policy on figure traces (one point per pool snapshot, 5 s apart): a learner that waits
for data grows the pool, finished samples that pile up or go stale shrink it, with hysteresis, a sustain count,
a cool-down and the bounds; and the fleet hands a decision to the run's control as `asyncrl scale` does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncrl.config import load_config
from asyncrl.config.rollout import AutoscaleConfig
from asyncrl.controller.autoscale import Autoscaler, Decision, Figures

CONFIG = AutoscaleConfig(min=1, max=3, cooldown_s=30, sustain=3)


def _run(trace: list[tuple[float, float, float]], size: int = 1, config: AutoscaleConfig = CONFIG):
    """Feed (learner idle, ready batches, stale fraction) points 5 s apart; -> [(t, new size, reason)]."""
    scaler, changes = Autoscaler(config), []
    for i, (idle, ready, stale) in enumerate(trace):
        decision = scaler.decide(size, Figures(wall_s=5.0 * (i + 1), learner_idle=idle, stale_drop=stale, ready_batches=ready))
        if decision is not None:
            size = decision.size
            changes.append((5.0 * (i + 1), size, decision.reason))
    return changes


def test_a_learner_waiting_for_data_grows_the_pool_one_engine_per_cool_down_up_to_max():
    changes = _run([(0.6, 0.0, 0.0)] * 40)  # 200 s of a learner idle 60% of the time
    assert [(t, n) for t, n, _ in changes] == [(30.0, 2), (60.0, 3)]  # cool-down from the start, then from each change
    assert changes[0][2] == "learner idle 60% >= 25%"


def test_samples_piling_up_or_going_stale_shrink_the_pool_to_min():
    piled = _run([(0.0, 3.0, 0.0)] * 20, size=3)
    assert [(t, n) for t, n, _ in piled] == [(30.0, 2), (60.0, 1)] and piled[0][2] == "learner idle 0%, 3.0 batches ready"
    stale = _run([(0.02, 0.5, 0.3)] * 8, size=2)
    assert stale == [(30.0, 1, "learner idle 2%, 30% dropped stale")]


def test_between_the_thresholds_nothing_changes_and_a_short_blip_does_not_act():
    assert _run([(0.15, 5.0, 0.5)] * 40, size=2) == []  # learner idle between shrink (5%) and grow (25%)
    blips = [(0.6, 0.0, 0.0), (0.6, 0.0, 0.0), (0.1, 0.0, 0.0)] * 20  # two snapshots idle, one not: never 3 in a row
    assert _run(blips) == []
    assert _run([(0.0, 0.5, 0.0)] * 40, size=2) == []  # a busy learner alone is no reason to shrink


def test_a_slow_then_fast_learner_goes_1_to_2_and_back():
    trace = [(0.5, 0.0, 0.0)] * 8 + [(0.0, 2.5, 0.0)] * 12  # data-starved for 40 s, then batches pile up
    # shrink streak from 45 s reaches 3 at 55 s; the cool-down from the change at 30 s ends at 60 s
    assert [(t, n) for t, n, _ in _run(trace)] == [(30.0, 2), (60.0, 1)]


def test_a_size_outside_the_bounds_is_brought_back_one_engine_at_a_time():
    assert [(t, n) for t, n, _ in _run([(0.1, 0.0, 0.0)] * 14, size=5)] == [(30.0, 4), (60.0, 3)]


def test_bounds_and_thresholds_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError, match="rollout.autoscale.min = 3 exceeds rollout.autoscale.max = 2"):
        AutoscaleConfig(min=3, max=2)
    with pytest.raises(ValueError, match="shrink_learner_idle = 0.3 must be below grow_learner_idle = 0.25"):
        AutoscaleConfig(max=2, shrink_learner_idle=0.3)


class FakePool:
    names, joining = ["rollout-0"], []


def test_the_fleet_hands_a_decision_to_the_runs_control_and_logs_it(tmp_path):
    from asyncrl.controller.loop import Controller
    from asyncrl.telemetry.sinks import LiveRates, PoolSnapshot

    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0",
                             "rollout.autoscale.max=2", "rollout.autoscale.cooldown_s=10", "rollout.autoscale.sustain=1"])  # fmt: skip
    fleet = Controller(cfg, tmp_path).fleet
    fleet.rollout = FakePool()
    live = LiveRates(30.0, 0.0, 0.0, rollout_idle_fraction=0.0, learner_idle_fraction=0.8, stale_drop_fraction=0.0)
    snapshot = PoolSnapshot(wall_s=12.0, version=3, counters={}, queue={"batch_groups": 4}, engines={}, live=live)
    fleet.autoscale(snapshot)
    assert fleet.control.poll().rollout == 2
    (event,) = fleet.pool_events
    assert (event["kind"], event["from_size"], event["size"], event["reason"]) == ("autoscale", 1, 2, "learner idle 80% >= 25%")


def test_the_cool_down_counts_from_when_a_joining_engine_serves(tmp_path):
    from asyncrl.controller.loop import Controller
    from asyncrl.telemetry.sinks import LiveRates, PoolSnapshot

    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0",
                             "rollout.autoscale.max=2", "rollout.autoscale.cooldown_s=10", "rollout.autoscale.sustain=1"])  # fmt: skip
    fleet = Controller(cfg, tmp_path).fleet
    fleet.rollout = FakePool()
    fleet.rollout.names, fleet.rollout.joining = ["rollout-0"], ["rollout-1"]  # one still joining
    live = LiveRates(30.0, 0.0, 0.0, rollout_idle_fraction=0.0, learner_idle_fraction=0.0, stale_drop_fraction=0.0)
    queue = {"batch_groups": 4, "ready_groups": 12}
    for wall_s in (20.0, 30.0):
        fleet.autoscale(PoolSnapshot(wall_s=wall_s, version=3, counters={}, queue=queue, engines={}, live=live))
    assert fleet.pool_events == []  # past the cool-down from the start, but an engine was joining at 30 s
    fleet.rollout.names, fleet.rollout.joining = ["rollout-0", "rollout-1"], []
    for wall_s in (35.0, 40.0):  # it served from 30 s on: the cool-down ends at 40 s
        fleet.autoscale(PoolSnapshot(wall_s=wall_s, version=3, counters={}, queue=queue, engines={}, live=live))
    assert [(e["from_size"], e["size"], e["reason"]) for e in fleet.pool_events] == [(2, 1, "learner idle 0%, 3.0 batches ready")]
    assert fleet.autoscaler.last_change_s == 40.0


def test_an_autoscale_minimum_below_min_healthy_engines_and_a_bad_learner_delay_are_refused_naming_the_keys():
    with pytest.raises(ValueError, match="rollout.autoscale.min = 1 is below rollout.min_healthy_engines = 2"):
        load_config(None, ["rollout.num_workers=2", "rollout.min_healthy_engines=2", "rollout.autoscale.max=3"])
    with pytest.raises(ValueError, match=r"faults.learner_delay_s: \{0: 1.0\} wants a step >= 1"):
        load_config(None, ['faults.learner_delay_s={"0": 1}'])
    faults = load_config(None, ['faults.learner_delay_s={"1": 0.5, "12": 2}']).faults
    assert [faults.learner_delay(step) for step in (1, 11, 12, 40)] == [0.5, 0.5, 2.0, 2.0]


def test_engines_idle_because_the_queue_holds_starts_back_count_as_samples_piling_up():
    scaler = Autoscaler(AutoscaleConfig(min=1, max=2, cooldown_s=5, sustain=2))
    held = Figures(wall_s=0, learner_idle=0.01, stale_drop=0.0, ready_batches=1.0, rollout_idle=0.9)
    decisions = [scaler.decide(2, replace(held, wall_s=t)) for t in (2.0, 4.0, 6.0)]
    assert decisions[:2] == [None, None] and decisions[2] == Decision(1, "learner idle 1%, engines idle 90%")
    busy = Autoscaler(AutoscaleConfig(min=1, max=2, cooldown_s=5, sustain=2))
    assert [busy.decide(2, replace(held, wall_s=t, rollout_idle=0.3)) for t in (6.0, 8.0)] == [None, None]
