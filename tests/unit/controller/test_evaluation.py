"""The controller's held-out evaluation: k samples give mean@k and pass@k, and an evaluation is credited to
a policy version only if the engines served that version for every request (a fake rollout pool)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.controller.loop import Controller
from asyncrl.rollout.engine import EvalResult
from asyncrl.testing import make_prompt


class FakeRollout:
    """Answers evaluations with fixed completions; `versions` lists what each successive call reports. A call
    dispatched (`start_evaluate`) is in once `done` is set (the engines answered)."""

    def __init__(self, texts: list[tuple[str, ...]], versions: list[frozenset[int]]):
        self.texts, self.versions, self.calls, self.done = texts, versions, [], True
        self.polls_until_done: int | None = None
        """Set: `done` turns true after this many more `spread_done` calls."""

    def start_evaluate(self, prompts, max_tokens, temperature, samples):
        self.calls.append((len(prompts), max_tokens, temperature, samples))
        served = self.versions[min(len(self.calls), len(self.versions)) - 1]
        return [EvalResult(texts, ("stop",) * len(texts), served) for texts in self.texts]

    def spread_done(self, call) -> bool:
        if self.polls_until_done is not None:
            self.polls_until_done -= 1
            self.done = self.polls_until_done <= 0
        return self.done

    def finish_spread(self, call):
        return call


class FakeLearner:
    """Records the folders `export_hf` was asked for, and writes one file there."""

    def __init__(self):
        self.exports = []

    def export_hf(self, folder):
        self.exports.append(folder)
        folder.mkdir()
        (folder / "config.json").write_text("{}")


class AdmissionLog:
    """A replay queue that only records `hold_admission`: `held` now, `calls` in order."""

    def __init__(self):
        self.held, self.calls = False, []

    def hold_admission(self, held: bool) -> None:
        self.held = held
        self.calls.append(held)


def _controller(tmp_path, rollout: FakeRollout, *overrides: str) -> Controller:
    """A controller whose evaluations are waited for (`eval.blocking=true`) unless `overrides` say otherwise."""
    overrides = ("eval.blocking=true", *overrides)
    controller = Controller(load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "rollout.max_tokens=8", *overrides]), tmp_path)
    controller.evaluation.eval_set = [make_prompt("a", ground_truth="12"), make_prompt("b", ground_truth="7")]
    controller.fleet.rollout = rollout
    controller.fleet.learner = FakeLearner()
    controller.fleet.queue = AdmissionLog()
    controller.state.version = 3
    return controller


def test_a_new_best_is_exported_only_while_the_learner_holds_the_evaluated_weights(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3})])
    controller = _controller(tmp_path, rollout, "checkpoint.export_best=true")
    controller._evaluate(0.0)
    assert controller.fleet.learner.exports == [tmp_path / "best_model.partial"] and (tmp_path / "best_model" / "config.json").is_file()
    assert "best_export_s" in controller.evaluation.evals[-1] and controller.evaluation.best.record["accuracy"] == 0.5
    rollout.texts = [("12",), ("7",)]  # better, but the learner has trained past the version the engines serve
    controller.state.learner_at_version = False
    controller._evaluate(0.0)
    assert len(controller.fleet.learner.exports) == 1 and controller.evaluation.best.record == {**controller.evaluation.best.record, "accuracy": 1.0, "exported": False}
    assert "best_export_s" not in controller.evaluation.evals[-1]
    assert controller.evaluation.evals[-1]["blocking"] is True and controller.evaluation.evals[-1]["eval_wait_s"] >= 0


def test_k_samples_give_mean_at_k_and_pass_at_k(tmp_path):
    # Prompt a: 2 of 4 right; prompt b: none right.
    rollout = FakeRollout([("12", "13", "12", "1"), ("8", "9", "8", "0")], [frozenset({3})])
    controller = _controller(tmp_path, rollout, "eval.temperature=1.0", "eval.samples=4")
    controller._evaluate(0.0)
    record = controller.evaluation.evals[-1]
    assert rollout.calls == [(2, 8, 1.0, 4)]  # max_tokens: rollout.max_tokens
    assert record["accuracy"] == record["mean_at_k"] == pytest.approx(2 / 8)
    # pass@1 = (2/4 + 0)/2; pass@2 = (1 - C(2,2)/C(4,2))/2 = (5/6)/2; pass@3 = pass@4 = (1 + 0)/2.
    assert record["pass_at_k"] == pytest.approx({"1": 0.25, "2": 5 / 12, "3": 0.5, "4": 0.5})
    assert (record["temperature"], record["samples"], record["served_versions"], record["straddled"]) == (1.0, 4, [3], False)


def test_greedy_by_default_with_the_accuracy_as_before(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3})])
    controller = _controller(tmp_path, rollout)
    controller._evaluate(0.0)
    assert rollout.calls == [(2, 8, 0.0, 1)]
    assert controller.evaluation.evals[-1]["accuracy"] == 0.5 and controller.evaluation.evals[-1]["pass_at_k"] == {"1": 0.5}


def test_an_evaluation_that_straddled_a_version_change_runs_again(tmp_path):
    rollout = FakeRollout([("12",), ("7",)], [frozenset({2, 3}), frozenset({3})])
    controller = _controller(tmp_path, rollout)
    controller._evaluate(0.0)
    assert len(rollout.calls) == 2
    assert (controller.evaluation.evals[-1]["served_versions"], controller.evaluation.evals[-1]["straddled"]) == ([3], False)


def test_an_evaluation_that_straddles_twice_says_so(tmp_path):
    rollout = FakeRollout([("12",), ("7",)], [frozenset({3, 4})])
    controller = _controller(tmp_path, rollout)
    controller._evaluate(0.0)
    assert len(rollout.calls) == 2
    assert (controller.evaluation.evals[-1]["served_versions"], controller.evaluation.evals[-1]["straddled"]) == ([3, 4], True)
    assert controller.evaluation.straddled == 1


def _admission_at_dispatch(controller: Controller, rollout: FakeRollout) -> list[bool]:
    """Whether the queue held admission at each evaluation the engines were sent, in order."""
    seen, dispatch = [], rollout.start_evaluate

    def start_evaluate(*args, **kwargs):
        seen.append(controller.fleet.queue.held)
        return dispatch(*args, **kwargs)

    rollout.start_evaluate = start_evaluate
    return seen


def test_a_blocking_evaluation_has_the_engines_to_itself_and_admission_reopens_after_it(tmp_path):
    rollout = FakeRollout([("12",), ("7",)], [frozenset({2, 3}), frozenset({3})])
    controller = _controller(tmp_path, rollout)
    seen = _admission_at_dispatch(controller, rollout)
    controller._evaluate(0.0, wait=True)  # the first (run again: it straddled), then a periodic one
    controller._evaluate(0.0)
    assert seen == [True] * 3 and controller.fleet.queue.calls == [True, False] * 2
    rollout.finish_spread = lambda call: 1 / 0  # an evaluation that fails still reopens admission
    with pytest.raises(ZeroDivisionError):
        controller._evaluate(0.0)
    assert controller.fleet.queue.calls == [True, False] * 3


def test_non_blocking_evaluations_run_beside_new_groups_and_the_run_end_does_not(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3}), frozenset({4})])
    controller, _ = _non_blocking(tmp_path, rollout)
    seen = _admission_at_dispatch(controller, rollout)
    controller._evaluate(0.0, wait=True)  # before the first step: the engines generate the first batch beside it
    controller._evaluate(0.0)
    _train_step(controller)
    controller._last_evaluation(0.0)  # v4 evaluated alone: nothing trains on what starts now
    assert seen == [False, False, True] and controller.fleet.queue.calls == [True, False]


def test_several_greedy_samples_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="eval.samples = 4 needs eval.temperature > 0"):
        load_config(None, ["eval.samples=4"])


# Non-blocking evaluation (`eval.blocking: false`, the default): the scheduling around the learner's steps.


def _non_blocking(tmp_path, rollout: FakeRollout, *overrides: str) -> tuple[Controller, list[int]]:
    """A controller with the default non-blocking evaluation whose publications are only counted: -> it and the
    steps at which it published (a publication moves the version by one unless it was held back)."""
    controller = _controller(tmp_path, rollout, "eval.blocking=false", *overrides)
    published: list[int] = []

    def publish(advance=True):
        controller.publish_deferred = False
        controller.state.version += advance
        controller.state.learner_at_version = True
        published.append(controller.state.step)

    controller._publish = publish
    return controller, published


def _train_step(controller: Controller) -> None:
    """What the loop does around one learner step, less the step: the publication (every step) made or held back,
    then the evaluation collected if it is in (and a held-back publication made)."""
    controller.state.step += 1
    controller.state.learner_at_version = False
    controller._publish_unless_evaluating()
    controller._collect_evaluation(wait=False)


def test_a_non_blocking_evaluation_lands_steps_later_labelled_with_the_version_it_started_at(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3})])
    controller, published = _non_blocking(tmp_path, rollout)
    controller.state.step = 30
    controller._evaluate(0.0)
    assert controller.evaluation.pending is not None and controller.evaluation.evals == []
    rollout.done = False  # the engines are still evaluating: the learner trains on, its publications held back
    for _ in range(3):
        _train_step(controller)
    # The learner's version moves on (the staleness bound counts these steps); the engines stay at 3.
    assert published == [] and controller.publish_deferred and controller.state.version == 6
    rollout.done = True
    _train_step(controller)  # step 34: its publication held back, the evaluation collected, then the publication made
    record = controller.evaluation.evals[-1]
    assert (record["version"], record["step"], record["recorded_at_step"], record["served_versions"]) == (3, 30, 34, [3])
    assert (record["accuracy"], record["blocking"], record["straddled"], record["publishes_deferred"]) == (0.5, False, False, 4)
    assert published == [34] and not controller.publish_deferred and controller.evaluation.publishes_deferred == 4
    assert controller.state.version == 7  # the held-back publication sends the learner's version, 7
    _train_step(controller)  # no evaluation in flight: publications as usual
    assert published == [34, 35] and len(controller.evaluation.evals) == 1 and controller.state.version == 8


def test_a_straddling_non_blocking_evaluation_is_marked_not_rerun_and_counted(tmp_path):
    rollout = FakeRollout([("12",), ("7",)], [frozenset({3, 4})])
    controller, _ = _non_blocking(tmp_path, rollout)
    controller._evaluate(0.0)
    controller._collect_evaluation(wait=True)
    assert len(rollout.calls) == 1
    assert (controller.evaluation.evals[-1]["straddled"], controller.evaluation.straddled) == (True, 1)


def test_an_evaluation_due_while_one_is_in_flight_waits_for_it_and_its_publication(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3}), frozenset({4})])
    controller, published = _non_blocking(tmp_path, rollout)
    controller._evaluate(0.0)
    rollout.done = False
    _train_step(controller)
    controller._evaluate(0.0)  # the first is collected (waited for), its held-back publication made, then v4 starts
    assert [e["version"] for e in controller.evaluation.evals] == [3] and published == [1]
    assert controller.evaluation.pending is not None and controller.evaluation.pending.record["version"] == 4


def test_the_best_of_a_non_blocking_evaluation_is_the_policy_exported_when_it_started(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3})])
    controller, _ = _non_blocking(tmp_path, rollout, "checkpoint.export_best=true")
    controller._evaluate(0.0)
    learner = controller.fleet.learner
    assert learner.exports == [tmp_path / "best_model.candidate"]  # at the start, while it holds version 3
    rollout.done = False
    _train_step(controller)  # the learner trains past version 3 before the result arrives
    rollout.done = True
    _train_step(controller)
    assert (tmp_path / "best_model" / "config.json").is_file() and not (tmp_path / "best_model.candidate").exists()
    assert controller.evaluation.best.record == {"step": 0, "version": 3, "samples_trained": 0, "accuracy": 0.5, "exported": True}
    rollout.texts = [("1",), ("8",)]  # worse: its candidate is removed, the best kept
    controller._evaluate(0.0)
    controller._collect_evaluation(wait=True)
    assert len(learner.exports) == 2 and not (tmp_path / "best_model.candidate").exists()
    assert controller.evaluation.best.record["version"] == 3


def test_the_run_end_waits_for_the_evaluation_in_flight_and_a_stop_drops_it(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3}), frozenset({4})])
    controller, published = _non_blocking(tmp_path, rollout)
    controller._evaluate(0.0)
    rollout.done = False
    _train_step(controller)
    controller._last_evaluation(0.0)  # v3's evaluation recorded, its publication made, v4 evaluated (waited for)
    assert [e["version"] for e in controller.evaluation.evals] == [3, 4] and published == [1]
    assert controller.evaluation.pending is None
    controller._evaluate(0.0)
    controller.request_stop("a signal")
    controller._last_evaluation(0.0)
    assert controller.evaluation.pending is None and controller.evaluation.dropped == 1
    assert len(controller.evaluation.evals) == 2


class FakeQueue:
    """No batch until `opened()` (the admission window is used up until then); counts the calls."""

    def __init__(self, opened):
        self.opened, self.calls = opened, 0

    def backlog_groups(self) -> int:
        return 10**6

    def get_batch(self, groups, version, timeout):
        self.calls += 1
        if not self.opened():
            raise TimeoutError
        return "batch"


def test_a_learner_that_gets_no_batch_without_the_held_back_publication_waits_for_the_evaluation(tmp_path):
    rollout = FakeRollout([("12",), ("8",)], [frozenset({3})])
    controller, published = _non_blocking(tmp_path, rollout, "mode=sync", "buffer.max_staleness=0")
    controller._evaluate(0.0)
    rollout.done = False
    _train_step(controller)
    controller.fleet.queue = FakeQueue(lambda: bool(published))
    rollout.polls_until_done = 3  # the evaluation is in at the third look
    assert controller._next_batch() == "batch"
    assert published == [1] and [e["version"] for e in controller.evaluation.evals] == [3]
    assert controller.fleet.queue.calls == 4  # three turns without a batch, then the batch of the new version


def test_a_learner_that_gets_no_batch_while_a_sync_is_in_flight_waits_for_the_sync(tmp_path):
    """Steps trained while a publication was held back use up the admission window of the old version: the batch
    after the late publication comes only once the engines confirmed it (admission opens then)."""
    controller, _ = _non_blocking(tmp_path, FakeRollout([("12",)], [frozenset({3})]))
    closed: list[str] = []
    controller.in_flight = "the sync of version 4"

    def close_sync():
        if controller.in_flight is not None:
            closed.append(controller.in_flight)
        controller.in_flight = None

    controller._close_sync = close_sync
    controller.fleet.queue = FakeQueue(lambda: bool(closed))
    assert controller._next_batch() == "batch" and closed == ["the sync of version 4"]
