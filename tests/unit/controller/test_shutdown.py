"""`Controller.shutdown` stops every part even when one fails (a learner rank that died makes the learner's
shutdown raise), then raises that failure: the queue still closes its trajectory log, the engines still stop.
And the stop signals' handler (`run._stop_requests`): the first asks for a stop, a run still stopping long after
prints every thread's stack, the second raises."""

from __future__ import annotations

import importlib

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
    fleet = controller.fleet
    fleet.rollout, fleet.tools, fleet.sync = _Part("rollout", calls), None, _Part("sync", calls)
    fleet.learner, fleet.queue = _Part("learner", calls, dead), _Part("queue", calls)
    with pytest.raises(LearnerCallError, match="learner rank 0: shutdown failed"):
        controller.shutdown()
    assert calls == ["rollout", "learner", "sync", "queue"]


class _Stoppable:
    stop_requested: str | None = None

    def request_stop(self, reason: str) -> None:
        self.stop_requested = reason


def test_the_first_sigterm_asks_for_a_stop_and_a_run_still_stopping_later_prints_its_stacks(monkeypatch, capfd):
    import os
    import signal
    import time

    run = importlib.import_module("asyncrl.controller.run")  # the module (the package exports the function)
    monkeypatch.setattr(run, "STOP_STACKS_AFTER_S", 0.3)
    controller = _Stoppable()
    with run._stop_requests(controller):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of this thread
        assert controller.stop_requested == "SIGTERM received"
        assert "most recent call first" not in capfd.readouterr().err
        time.sleep(0.6)
        assert "most recent call first" in capfd.readouterr().err  # faulthandler's dump: every thread's stack
        with pytest.raises(KeyboardInterrupt, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    assert getattr(signal.getsignal(signal.SIGTERM), "__name__", "") != "handler"  # the previous handler is back


def test_leaving_the_stop_context_disarms_the_stack_dump(monkeypatch, capfd):
    import os
    import signal
    import time

    run = importlib.import_module("asyncrl.controller.run")  # the module (the package exports the function)
    monkeypatch.setattr(run, "STOP_STACKS_AFTER_S", 0.3)
    with run._stop_requests(_Stoppable()):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    time.sleep(0.5)
    assert "most recent call first" not in capfd.readouterr().err
