"""The controller's held-out evaluation: k samples give mean@k and pass@k, and an evaluation is credited to
a policy version only if the engines served that version for every request (a fake rollout pool)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.controller.loop import Controller
from asyncrl.rollout.engine import EvalResult
from asyncrl.testing import make_prompt


class FakeRollout:
    """Answers `evaluate` with fixed completions; `versions` lists what each successive call reports."""

    def __init__(self, texts: list[tuple[str, ...]], versions: list[frozenset[int]]):
        self.texts, self.versions, self.calls = texts, versions, []

    def evaluate(self, prompts, max_tokens, temperature, samples):
        self.calls.append((len(prompts), max_tokens, temperature, samples))
        served = self.versions[min(len(self.calls), len(self.versions)) - 1]
        return [EvalResult(texts, ("stop",) * len(texts), served) for texts in self.texts]


class FakeLearner:
    """Records the folders `export_hf` was asked for, and writes one file there."""

    def __init__(self):
        self.exports = []

    def export_hf(self, folder):
        self.exports.append(folder)
        folder.mkdir()
        (folder / "config.json").write_text("{}")


def _controller(tmp_path, rollout: FakeRollout, *overrides: str) -> Controller:
    controller = Controller(load_config(None, [f"output_dir={tmp_path}", "telemetry.progress=false", "rollout.max_tokens=8", *overrides]), tmp_path)
    controller.evaluation.eval_set = [make_prompt("a", ground_truth="12"), make_prompt("b", ground_truth="7")]
    controller.fleet.rollout = rollout
    controller.fleet.learner = FakeLearner()
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


def test_several_greedy_samples_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="eval.samples = 4 needs eval.temperature > 0"):
        load_config(None, ["eval.samples=4"])
