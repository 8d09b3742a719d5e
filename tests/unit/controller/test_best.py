"""`BestPolicy`: which evaluation is the best so far, and what `best_model/` holds (a stand-in export writes the
version it was given, so the folder says which policy it holds)."""

import json

from asyncrl.controller.best import BestPolicy


def _record(step: int, accuracy: float) -> dict:
    return {"step": step, "version": step, "samples_trained": 256 * step, "accuracy": accuracy, "wall_s": 1.0}


def _exporter(version: int):
    def export_hf(folder):
        folder.mkdir()
        (folder / "model.txt").write_text(f"v{version}")

    return export_hf


def _held(tmp_path) -> tuple[str, int]:
    folder = tmp_path / "best_model"
    return (folder / "model.txt").read_text(), json.loads((folder / "asyncrl_eval.json").read_text())["step"]


def test_only_an_evaluation_that_beats_every_earlier_one_replaces_the_best(tmp_path):
    best = BestPolicy(tmp_path, export=True)
    assert best.offer(_record(0, 0.2), _exporter(0))
    assert _held(tmp_path) == ("v0", 0)
    assert best.offer(_record(10, 0.5), _exporter(10))
    assert not best.offer(_record(20, 0.5), _exporter(20))  # a tie keeps the earlier one
    assert not best.offer(_record(30, 0.4), _exporter(30))
    assert _held(tmp_path) == ("v10", 10)
    assert best.record == {"step": 10, "version": 10, "samples_trained": 2560, "accuracy": 0.5, "exported": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]  # no partial folder left


def test_a_best_the_learner_has_trained_past_is_recorded_but_not_exported(tmp_path):
    best = BestPolicy(tmp_path, export=True)
    best.offer(_record(0, 0.2), _exporter(0))
    assert best.offer(_record(7, 0.6), None)
    assert best.record["step"] == 7 and best.record["exported"] is False
    assert _held(tmp_path) == ("v0", 0)  # the folder still says what it holds


def test_without_export_best_nothing_is_written_and_the_record_survives_a_resume(tmp_path):
    best = BestPolicy(tmp_path, export=False)
    best.offer(_record(0, 0.2), _exporter(0))
    best.offer(_record(10, 0.3), _exporter(10))
    assert not (tmp_path / "best_model").exists()
    resumed = BestPolicy(tmp_path, export=False)
    resumed.load_state_dict(json.loads(json.dumps(best.state_dict())))  # through a checkpoint's extra.json
    assert not resumed.offer(_record(20, 0.3), _exporter(20)) and resumed.record["step"] == 10
