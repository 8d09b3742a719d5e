"""The best held-out evaluation of a run and, with `checkpoint.export_best`, its policy kept in `best_model/`.

RL on a small model can lose accuracy late in a run (the default W1 run fell from 0.72 to 0.58 over its last 40
steps once in six runs: benchmarks/RESULTS.md). The final export is the last policy; this keeps the best one
the run evaluated: an evaluation whose accuracy beats every earlier one (ties keep the earlier) is recorded,
and its policy exported as a Hugging Face folder that replaces `best_model/` whole (written beside it, then
renamed; on an object store the export replaces it and `asyncrl_eval.json` is uploaded after the weights), with
`best_model/asyncrl_eval.json` saying which evaluation it is. An evaluation of a version the
learner has already trained past (the last one, when `learner.max_steps` is not a multiple of
`weight_sync.every_steps`) is recorded but cannot be exported. An evaluation beside training (`eval.blocking: false`)
lands steps later: its policy was exported when it started (`controller.evaluation`), and its `export_hf` moves that
folder here. The record survives a resume (checkpoints carry it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.remote import Store, join

__all__ = ["BEST_FIELDS", "BestPolicy"]

BEST_FIELDS = ("step", "version", "samples_trained", "accuracy")
"""What `summary.json`'s `best_eval` and `best_model/asyncrl_eval.json` keep of an evaluation record."""


class BestPolicy:
    def __init__(self, out: Path, export: bool, remote: tuple[str, Store] | None = None):
        self.folder = out / "best_model"
        self.export = export
        self.remote = remote
        """(the run folder's URI, its store) when the run folder is on an object store."""
        self.record: dict | None = None
        """The best evaluation so far (`BEST_FIELDS`, plus `exported`: whether `best_model/` holds its policy)."""

    def offer(self, record: dict, export_hf: Callable[[Any], None] | None) -> bool:
        """Record `record` (an evaluation) if it beats every earlier one; -> whether it did. `export_hf(folder)`
        writes the evaluated policy there (None: the learner's weights are no longer the evaluated ones)."""
        if self.record is not None and record["accuracy"] <= self.record["accuracy"]:
            return False
        self.record = {field: record[field] for field in BEST_FIELDS} | {"exported": False}
        described = json.dumps({field: record[field] for field in BEST_FIELDS}, indent=2) + "\n"
        if self.export and export_hf is not None and self.remote is not None:
            uri, store = join(self.remote[0], "best_model"), self.remote[1]
            export_hf(uri)
            store.write_text(join(uri, "asyncrl_eval.json"), described)
            self.record["exported"] = True
        elif self.export and export_hf is not None:
            staging = self.folder.with_name(self.folder.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            export_hf(staging)
            (staging / "asyncrl_eval.json").write_text(described)
            shutil.rmtree(self.folder, ignore_errors=True)
            staging.rename(self.folder)
            self.record["exported"] = True
        return True

    def state_dict(self) -> dict | None:
        return self.record

    def load_state_dict(self, record: dict | None) -> None:
        self.record = record
