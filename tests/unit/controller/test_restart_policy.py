"""The restart policy as the pools and the fleet apply it: a dead engine past its slot's budget is not replaced
and its slot is quarantined; below the minimum healthy size the run is asked to stop, naming the quarantined."""

from __future__ import annotations

import pytest

from asyncrl.cluster.restarts import RestartBudget
from asyncrl.config import RolloutConfig, load_config
from asyncrl.controller.loop import Controller
from asyncrl.rollout.membership import PoolEvent
from asyncrl.rollout.pool import RolloutPool


def test_a_dead_engine_past_its_budget_is_not_replaced_and_its_slot_is_named():
    pool = RolloutPool("model", RolloutConfig(max_restarts_per_engine=0), replace_dead=True)
    pool._workers["rollout-0"] = object()  # a worker that died: nothing of Ray is touched on this path
    event = pool._replace("rollout-0", kind="hung", detail="no heartbeat answer within 10s")
    assert (event.kind, event.replacement, pool.names, pool.joining) == ("hung", None, [], [])
    assert [(e.worker, e.kind) for e in pool._events] == [("rollout-0", "hung"), ("rollout-0", "quarantined")]
    assert str(pool._events[1]) == (
        "rollout engine slot rollout-0 quarantined, not restarted again: "
        "rollout-0 was its last engine: its restart budget is spent (0 restarts)"
    )


class FakeRollout:
    def __init__(self, names, events, quarantined):
        self.names, self.joining, self._events = names, [], events
        self.restarts = RestartBudget(5, 3, 60)
        self.restarts.quarantined.update(quarantined)

    def poll(self):
        events, self._events = self._events, []
        return events


def _fleet(tmp_path, *overrides):
    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0", *overrides])
    controller = Controller(cfg, tmp_path)
    return controller, controller.fleet


def test_below_min_healthy_engines_the_run_stops_naming_the_quarantined_slots(tmp_path):
    controller, fleet = _fleet(tmp_path, "rollout.num_workers=3", "rollout.min_healthy_engines=2")
    why = "rollout-4 was its last engine: 3 failures within 60s"
    fleet.rollout = FakeRollout(["rollout-0", "rollout-2"], [PoolEvent("rollout-1", "quarantined", detail=why)], {"rollout-1": why})
    fleet.record_events()
    assert controller.stop_requested is None  # two engines left: enough
    fleet.rollout.names.pop()
    fleet.rollout._events = [PoolEvent("rollout-2", "quarantined", detail="its restart budget is spent (5 restarts)")]
    fleet.rollout.restarts.quarantined["rollout-2"] = "its restart budget is spent (5 restarts)"
    fleet.record_events()
    assert controller.stop_requested == (
        "1 healthy rollout engine(s) left, below rollout.min_healthy_engines = 2 (quarantined: "
        f"rollout-1: {why}; rollout-2: its restart budget is spent (5 restarts))"
    )
    assert [e["kind"] for e in fleet.pool_events] == ["quarantined", "quarantined"]


def test_with_no_minimum_the_run_goes_on_until_no_engine_is_left(tmp_path):
    controller, fleet = _fleet(tmp_path, "rollout.min_healthy_engines=0")
    fleet.rollout = FakeRollout([], [PoolEvent("rollout-0", "quarantined", detail="x")], {"rollout-0": "x"})
    fleet.record_events()
    assert controller.stop_requested == "0 healthy rollout engine(s) left, below rollout.min_healthy_engines = 0 (quarantined: rollout-0: x)"


def test_a_tool_worker_past_its_budget_is_quarantined_and_its_calls_go_to_the_others(monkeypatch):
    from asyncrl.config import ToolsConfig
    from asyncrl.envs.tools.pool import ToolPool, ToolPoolEvent, _Slot

    pool = ToolPool(ToolsConfig(num_workers=2, max_restarts_per_worker=1), prefix="t")
    pool._slots = {name: _Slot(handle=None, ping="ping") for name in pool.names}
    replaced, retired = [], []
    monkeypatch.setattr(pool, "_heard", lambda name, slot: ToolPoolEvent(name, "died") if name == "t-0" else None)
    monkeypatch.setattr(pool, "_replace", replaced.append)
    monkeypatch.setattr(pool, "_retire", lambda name: retired.append(pool._slots.pop(name)))
    assert [e.kind for e in pool.poll()] == ["died"] and replaced == ["t-0"]
    events = pool.poll()
    assert [(e.worker, e.kind) for e in events] == [("t-0", "died"), ("t-0", "quarantined")]
    assert str(events[1]) == "tool worker t-0 quarantined, not replaced: its restart budget is spent (1 restarts)"
    assert replaced == ["t-0"] and len(retired) == 1 and pool.healthy == 1


def test_chaos_faults_fall_on_distinct_seeded_steps_apart_from_the_listed_kills():
    import pytest

    from asyncrl.config.run import ChaosConfig
    from asyncrl.controller.faults import chaos_schedule

    chaos = ChaosConfig(kills=2, stops=1, seed=3, first_step=2, last_step=9)
    schedule = chaos_schedule(chaos, max_steps=10, excluded=[3, 7])
    assert sorted(schedule.values()) == ["kill", "kill", "stop"] and len(schedule) == 3
    assert all(2 <= s <= 9 and s not in (3, 7) for s in schedule)
    assert chaos_schedule(chaos, 10, [3, 7]) == schedule  # seeded
    assert chaos_schedule(ChaosConfig(), 10) == {}
    with pytest.raises(ValueError, match="faults.chaos: 3 faults .* do not fit on the 2 free steps from first_step = 8 to 10"):
        chaos_schedule(ChaosConfig(kills=3, first_step=8), max_steps=10, excluded=[9])


def test_an_engine_that_fails_to_start_is_restarted_under_its_slots_budget_then_quarantined(monkeypatch):
    pool = RolloutPool("model", RolloutConfig(max_restarts_per_engine=1), replace_dead=True)
    launched: list[str] = []
    monkeypatch.setattr(pool, "_launch", launched.append)
    monkeypatch.setattr(pool, "_abandon", lambda names: None)
    pool._index = iter(range(3, 10))  # rollout-2 was a scale-up; the next names are rollout-3, rollout-4, ...
    first = pool._failed_start("rollout-2", "rollout-2 failed to start: no room")
    assert (first.replacement, launched) == ("rollout-3", ["rollout-3"])
    assert str(first) == "rollout worker rollout-2 failed to start: rollout-2 failed to start: no room; restarted as rollout-3"
    second = pool._failed_start("rollout-3", "rollout-3 failed to start: no room")
    assert second.replacement is None and launched == ["rollout-3"]
    assert [(e.worker, e.kind) for e in pool._events] == [
        ("rollout-2", "failed_to_start"), ("rollout-3", "failed_to_start"), ("rollout-2", "quarantined")]  # fmt: skip
    assert pool.restarts.summary() == {
        "restarts": {"rollout-2": 1},
        "quarantined": {"rollout-2": "its restart budget is spent (1 restarts)"},
    }
    assert pool._events[2].detail == "rollout-3 failed to start, its last engine: its restart budget is spent (1 restarts)"


def test_an_engine_a_caller_waits_for_is_not_restarted_the_caller_hears_of_it(monkeypatch):
    pool = RolloutPool("model", RolloutConfig(), replace_dead=True)
    monkeypatch.setattr(pool, "_abandon", lambda names: None)
    pool._awaited.add("rollout-0")  # `start`: a model that does not load fails the run's start, with its reason
    assert pool._failed_start("rollout-0", "bad model").replacement is None
    assert pool.restarts.summary() == {"restarts": {}, "quarantined": {}}


def test_a_manual_scale_below_min_healthy_engines_is_refused_and_each_request_is_applied_once(tmp_path):
    from tests.unit.controller.test_local_scale import FakePool

    controller, fleet = _fleet(tmp_path, "rollout.num_workers=2", "rollout.min_healthy_engines=2")
    fleet.rollout = FakePool(["rollout-0", "rollout-1"])
    with pytest.raises(ValueError, match=r"rollout=1 is below rollout.min_healthy_engines = 2: refused"):
        fleet.request_scale("rollout", 1)  # the dashboard answers 400 with this
    fleet.control.set_size("rollout", 1)  # `asyncrl scale JOB rollout=1` reaches the job's control actor directly
    fleet.scale()
    assert [(e["kind"], e["size"]) for e in fleet.pool_events] == [("scale_refused", 1)] and fleet.rollout.removed == []
    fleet.request_scale("rollout", 3)
    fleet.scale()
    fleet.rollout.joining.clear()  # the new engine failed to start: the pool runs short, nothing scales it again
    fleet.scale()
    assert [e["kind"] for e in fleet.pool_events] == ["scale_refused", "scaled_up"]
