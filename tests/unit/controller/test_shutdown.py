"""`Controller.shutdown` stops every part even when one fails (a learner rank that died makes the learner's
shutdown raise), then raises that failure: the queue still closes its trajectory log, the engines still stop."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.controller.loop import Controller
from asyncrl.learner.pool import LearnerCallError


class _Part:
    def __init__(self, name: str, calls: list[str], error: Exception | None = None) -> None:
        self.name, self.calls, self.error = name, calls, error

    def shutdown(self) -> None:
        self.calls.append(self.name)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.calls.append(self.name)


def test_a_failing_part_does_not_keep_the_others_running_and_its_error_is_raised(tmp_path):
    controller = Controller(load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false"]), tmp_path)
    calls: list[str] = []
    dead = LearnerCallError("learner rank 0: shutdown failed: the rank died (ActorDiedError)")
    controller.rollout, controller.tools, controller.sync = _Part("rollout", calls), None, _Part("sync", calls)
    controller.learner, controller.queue = _Part("learner", calls, dead), _Part("queue", calls)
    with pytest.raises(LearnerCallError, match="learner rank 0: shutdown failed"):
        controller.shutdown()
    assert calls == ["rollout", "learner", "sync", "queue"]
