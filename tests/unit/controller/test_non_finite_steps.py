"""The controller's response to a step the learner skipped for a non-finite loss or gradient: counted, its
batch kept, and `learner.max_skipped_steps` such steps in a row stop the run (a finite step resets the count).
The learner's side (the skip itself, weights untouched) runs for real in tests/faults."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from asyncrl.config import load_config
from asyncrl.controller.faults import NonFiniteError
from asyncrl.controller.loop import Controller
from asyncrl.testing import make_group
from asyncrl.types import Batch, StepStats


def _stats(skipped: bool) -> StepStats:
    return StepStats(step=1, loss=float("nan") if skipped else 0.5, grad_norm=1.0, num_samples=2, num_tokens=8,
                     metrics={"skipped_step": float(skipped)})  # fmt: skip


def test_skipped_steps_are_counted_kept_and_three_in_a_row_stop_the_run(tmp_path):
    controller = Controller(load_config(None, [f"output_dir={tmp_path}", "learner.max_skipped_steps=3", "telemetry.progress=false"]), tmp_path)
    batch = Batch([make_group((1.0, 0.0), group_id="g7")], version=0)
    outcomes = [True, True, False, True, True]  # two, a finite step, two: never three in a row
    for step, skipped in enumerate(outcomes, start=1):
        controller.state.step = step
        controller.records.check_finite(_stats(skipped), batch)
    assert controller.records.skipped_steps == 4
    assert sorted(p.name for p in (tmp_path / "bad_batches").iterdir()) == [f"step-00000{s}.parquet" for s in (1, 2, 4, 5)]
    assert [r["group_id"] for r in pq.read_table(tmp_path / "bad_batches" / "step-000004.parquet").to_pylist()] == ["g7", "g7"]
    controller.state.step = 6
    with pytest.raises(NonFiniteError, match=r"3 steps in a row \(the last: step 6\) had a non-finite loss or gradient"):
        controller.records.check_finite(_stats(True), batch)
