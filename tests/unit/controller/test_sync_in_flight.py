"""The controller's one weight sync in flight (`SyncInFlight`): publishing opens it after closing the previous one
(engines take versions in order), closing it opens the queue's admission for its version and puts its timings on
the row of the step that published it, and that row (with the rows after it) is logged only then."""

from __future__ import annotations

import json

from asyncrl.config import load_config
from asyncrl.controller.loop import Controller
from asyncrl.testing import make_group
from asyncrl.types import Batch, StepStats
from asyncrl.weight_sync.base import SyncResult


class FakeSync:
    """Overlapping, unprobed syncs whose pending record is the version; `finish` notes what it closed."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.finished: list[int] = []

    def start(self, version: int, in_flight: bool | None = None) -> int:
        assert len(self.started) == len(self.finished), "a sync started while another was in flight"
        self.started.append(version)
        return version

    def finish(self, pending: int) -> SyncResult:
        self.finished.append(pending)
        return SyncResult(pending, seconds=0.25 * pending, num_bytes=100 * pending, num_tensors=1, num_buckets=1)

    def overlaps(self) -> bool:
        return True

    def probes(self, version: int) -> bool:
        return False


class FakeQueue:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def set_version(self, version: int) -> None:
        self.versions.append(version)


def _step(controller: Controller) -> None:
    controller.state.step += 1
    stats = StepStats(step=controller.state.step, loss=0.5, grad_norm=1.0, num_samples=2, num_tokens=8, metrics={})
    controller._record(stats, Batch([make_group((1.0, 0.0))], version=controller.state.version), 0.0)


def _logged_steps(tmp_path) -> list[dict]:
    path = tmp_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_one_sync_is_in_flight_and_its_step_row_waits_for_its_timings(tmp_path):
    controller = Controller(
        load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0"]),
        tmp_path,
    )
    sync, queue = controller.fleet.sync, controller.fleet.queue = FakeSync(), FakeQueue()

    _step(controller)
    controller._publish()
    assert controller.in_flight is not None and controller.in_flight.row["step"] == 1 and queue.versions == []
    controller._log_steps()
    assert _logged_steps(tmp_path) == []  # step 1's sync is still in flight

    _step(controller)
    controller._publish()  # closes version 1's sync before version 2's starts
    assert (sync.started, sync.finished, queue.versions) == ([1, 2], [1], [1])
    controller._log_steps()
    assert [(r["step"], r["sync_s"], r["sync_bytes"]) for r in _logged_steps(tmp_path)] == [(1, 0.25, 100)]

    controller._close_sync()
    controller._close_sync()  # nothing in flight: nothing to do
    controller._log_steps()
    assert controller.in_flight is None and (sync.finished, queue.versions) == ([1, 2], [1, 2])
    assert [(r["step"], r["version"], r["sync_s"]) for r in _logged_steps(tmp_path)] == [(1, 0, 0.25), (2, 1, 0.5)]


def test_a_publication_held_back_past_its_logged_row_leaves_that_row_as_it_was_logged(tmp_path):
    """An evaluation beside training holds a publication back; the step's row is logged meanwhile (nothing in
    flight). The held-back sync's timings must not change that row afterwards: the live page was handed the same
    dict that metrics.jsonl holds, and `asyncrl dash` on the finished run must serve what the live page served."""
    controller = Controller(
        load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "telemetry.dashboard_port=0"]),
        tmp_path,
    )
    sync, controller.fleet.queue = FakeSync(), FakeQueue()
    controller.fleet.sync = sync

    _step(controller)
    controller._log_steps()  # publication held back: step 1's row is logged at once
    logged = _logged_steps(tmp_path)
    controller.state.version += 1
    controller._publish(advance=False)  # the held-back publication, made once the evaluation is in
    assert controller.in_flight is not None and controller.in_flight.row is None
    controller._close_sync()
    assert sync.finished == [1] and controller.records.history[-1] == logged[0]  # no sync_s added after logging
    assert "sync_s" not in controller.records.history[-1]
