"""A learner starved by its filters: the controller says so live (a note, a `starved` alarm) and stops with a
`StarvedError` naming the cause, where a slow queue with nothing filtered still ends in the queue's timeout."""

from __future__ import annotations

import pytest

from asyncrl.buffer.starvation import Starvation, StarvedError
from asyncrl.config import load_config
from asyncrl.controller.loop import Controller
from tests.sinks import RecordingSink


class NeverReadyQueue:
    """Never hands out a batch; each `starvation` call reports the next record of `records` (the last one repeats)."""

    def __init__(self, records: list[Starvation]) -> None:
        self.records = records
        self.calls = 0

    def backlog_groups(self) -> int:
        return 1_000

    def get_batch(self, num_groups: int, learner_version: int, timeout_s: float) -> None:
        raise TimeoutError("ReplayQueue 'q': get_batch waited ...")

    def starvation(self) -> Starvation:
        self.calls += 1
        return self.records[min(self.calls, len(self.records)) - 1]


def _controller(tmp_path, records: list[Starvation]) -> tuple[Controller, RecordingSink]:
    cfg = load_config(
        None,
        [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0",
         "learner.prompts_per_step=4", "rollout.request_timeout_s=0.05"],
    )  # fmt: skip
    controller = Controller(cfg, tmp_path)
    controller.fleet.queue = NeverReadyQueue(records)  # type: ignore[assignment]
    controller.fleet.upkeep = lambda: None  # type: ignore[method-assign]
    seen = RecordingSink()
    controller.telemetry.sinks.append(seen)
    return controller, seen


def _filtered(n: int) -> Starvation:
    return Starvation(n, 0, {"filtered:zero_variance": n}, (0.0, 0.0), 60.0)


def test_a_starved_learner_is_told_live_and_stops_naming_the_filter(tmp_path):
    # 3 groups is below one step's 4: not yet starved; then 4, 5 (not double), 8 (double): two notes, one alarm
    controller, seen = _controller(tmp_path, [_filtered(3), _filtered(4), _filtered(5), _filtered(8)])
    with pytest.raises(StarvedError, match=r"no batch in 0 s: the last 8 groups were all filtered or failed \(zero_variance 8"):
        controller._next_batch()
    assert [n.split(" (")[0] for n in seen.notes] == [
        "learner starved: the last 4 groups were all filtered or failed",
        "learner starved: the last 8 groups were all filtered or failed",
    ]
    assert "buffer.filter_zero_variance=false" in seen.notes[0]
    assert [(a.name, a.value, a.threshold, a.active) for a in seen.alarms] == [("starved", 4, 4, True)]


def test_a_batch_clears_the_starved_alarm(tmp_path):
    controller, seen = _controller(tmp_path, [_filtered(4)])
    controller._watch_starvation()
    controller._watch_starvation(fed=True)
    assert [(a.name, a.active) for a in seen.alarms] == [("starved", True), ("starved", False)]
    assert controller.starved_groups_noted == 0


def test_a_slow_queue_with_nothing_filtered_still_times_out_as_before(tmp_path):
    controller, seen = _controller(tmp_path, [Starvation()])
    with pytest.raises(TimeoutError, match="ReplayQueue 'q'") as raised:
        controller._next_batch()
    assert not isinstance(raised.value, StarvedError) and seen.notes == [] and seen.alarms == []
