"""A local run (not a Ray job) is resized from its dashboard: the wanted size goes to the controller's own
control and `Fleet.scale` applies it between steps, as it does for `asyncrl scale` on a job."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.controller.loop import Controller
from asyncrl.telemetry.dashboard import Dashboard


class FakePool:
    def __init__(self, names: list[str]):
        self.names, self.joining, self.removed = list(names), [], []

    def add_worker(self, wait: bool = True) -> str:
        self.joining.append(f"rollout-{len(self.names) + len(self.joining)}")
        return self.joining[-1]

    def remove_worker(self, name: str) -> int:
        self.names.remove(name)
        self.removed.append(name)
        return 2  # requests handed back


def test_the_dashboards_scale_control_reaches_the_controllers_scale_step(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0"])
    controller = Controller(cfg, tmp_path)
    controller.fleet.rollout = FakePool(["rollout-0"])
    controller.fleet.scale()
    assert controller.fleet.pool_events == []  # nothing asked yet
    assert controller.fleet.request_scale("rollout", 3) == 3
    controller.fleet.scale()
    assert [(e["kind"], e["worker"]) for e in controller.fleet.pool_events] == [("scaled_up", "rollout-1"), ("scaled_up", "rollout-2")]
    controller.fleet.rollout.names, controller.fleet.rollout.joining = ["rollout-0", "rollout-1", "rollout-2"], []
    controller.fleet.request_scale("rollout", 1)
    controller.fleet.scale()
    assert controller.fleet.rollout.removed == ["rollout-2", "rollout-1"]  # the newest go first
    with pytest.raises(ValueError, match="rollout pool size must be an integer >= 1"):
        controller.fleet.request_scale("rollout", 0)
    with pytest.raises(ValueError, match="cannot scale pool 'critic'"):
        controller.fleet.request_scale("critic", 2)


def test_the_controller_hands_its_scale_request_to_the_dashboard(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0"])
    assert not any(isinstance(s, Dashboard) for s in Controller(cfg, tmp_path).telemetry.sinks)  # 0 = off
    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false"])
    controller = Controller(cfg, tmp_path)
    (dashboard,) = [s for s in controller.telemetry.sinks if isinstance(s, Dashboard)]
    assert dashboard.scaler == controller.fleet.request_scale
    assert (tmp_path / "events.jsonl").read_text().count('"kind": "phase"') == 1  # the dashboard's address
    dashboard.server.stop()


class FakeLearner:
    num_ranks = 1
    stopped = False

    def shutdown(self) -> None:
        self.stopped = True


def test_a_learner_size_the_config_refuses_is_named_and_leaves_the_pool_running(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0",
                             "learner.fsdp=never"])  # fmt: skip
    fleet = Controller(cfg, tmp_path).fleet
    fleet.rollout, fleet.learner = FakePool(["rollout-0"]), FakeLearner()
    assert fleet.learner_resize() is None  # nothing asked
    fleet.request_scale("learner", 1)
    fleet.scale()
    assert fleet.learner_resize() is None  # the size it has
    fleet.request_scale("learner", 2)
    fleet.scale()
    ranks, requested_at = fleet.learner_resize()
    assert ranks == 2 and requested_at is not None
    why = fleet.reform_learner(2, tmp_path / "checkpoint", version=3)
    assert "learner.num_ranks = 2 is refused" in why and "learner.fsdp = 'never'" in why
    assert not fleet.learner.stopped
    fleet.refused_learner = (ranks, requested_at)  # what the controller keeps: the same request is not retried
    assert fleet.learner_resize() is None
