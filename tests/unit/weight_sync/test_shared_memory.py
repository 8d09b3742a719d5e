"""SharedMemorySync with hand-written fakes, the transport choice, and the clean-up of dead runs' segments."""

import os
import subprocess
import sys

import pytest
import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.learner.pool import LearnerCall, LearnerCallError
from asyncrl.weight_sync.shared_memory import SharedMemorySync, segment_root, sweep_orphans
from asyncrl.weight_sync.transport import resolve_transport
from asyncrl.weights.segment import SegmentWriter
from tests.unit.weight_sync.fakes import FakeRollout


class FakeLearner:
    """Writes a real segment, as learner rank 0 does; a call started without waiting is written at once and
    its result (the record) stands for rank 0's object ref. `calls` lists what the sync asked for."""

    def __init__(self, fail_export=False):
        self.writer = None
        self.calls = []
        self.fail_export = fail_export

    def export_shared(self, root, version):
        self.calls.append(("export_shared", version))
        self.writer = self.writer or SegmentWriter(root)
        return self.writer.write({"w": torch.full((4, 4), float(version)), "b": torch.zeros(2)}, version)

    def start_export_shared(self, root, version):
        record = self.export_shared(root, version)
        self.calls[-1] = ("start_export_shared", version)
        return LearnerCall("export_shared", [record], 0.0)

    def finish_call(self, call):
        self.calls.append(("finish_call", call.refs[0].version))
        if self.fail_export:
            raise LearnerCallError("learner rank 0: export_shared failed: disk full")
        return call.refs


def test_the_engines_get_one_small_record_naming_the_slot_of_the_version(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    result = sync.finish(sync.start(3))
    [(refs, version, in_flight)] = sync.rollout.started
    assert (version, in_flight, len(refs)) == (3, True, 1)
    assert refs[0].path == sync.root + "-1" and refs[0].version == 3
    # payload: 16 + 2 float32 = 72 bytes in 2 tensors and one "bucket" (the record)
    assert (result.num_bytes, result.num_tensors, result.num_buckets) == (72, 2, 1)
    assert sync.latest().refs == refs


def test_only_the_first_export_is_waited_for_later_ones_are_handed_to_the_engines_pending(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    sync.finish(sync.start(1))
    pending = sync.start(2)
    assert sync.learner.calls == [("export_shared", 1), ("start_export_shared", 2)]
    # the engines get rank 0's pending record (here the record itself) for slot 2 % 2 = 0
    [_, (refs, version, _)] = sync.rollout.started
    assert version == 2 and refs == pending.export.refs[:1] and refs[0].path == sync.root + "-0"
    result = sync.finish(pending)
    assert sync.learner.calls[-1] == ("finish_call", 2)
    # sizes from the layout the first export fixed: 16 + 2 float32 = 72 bytes in 2 tensors
    assert (result.version, result.num_bytes, result.num_tensors) == (2, 72, 2)
    assert sync.latest().refs == refs


def test_a_failed_export_is_named_by_learner_rank_when_the_sync_finishes(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(fail_export=True), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    sync.finish(sync.start(1))
    with pytest.raises(LearnerCallError, match="learner rank 0: export_shared failed"):
        sync.finish(sync.start(2))


def test_shutdown_unlinks_both_slots(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    sync.start(1), sync.start(2)
    assert sorted(p.name[-1] for p in tmp_path.iterdir()) == ["0", "1"]
    sync.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_the_segments_of_a_killed_run_are_swept_and_a_live_runs_are_kept(tmp_path):
    # A process that writes a segment under its own pid and is then SIGKILLed: nothing of it cleans up.
    code = (
        "import os, sys, torch; from asyncrl.weights.segment import SegmentWriter;"
        "from asyncrl.weight_sync.shared_memory import segment_root;"
        "SegmentWriter(segment_root(sys.argv[1])).write({'w': torch.ones(8)}, 0); os.kill(os.getpid(), 9)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    dead = sorted(str(p) for p in tmp_path.iterdir())
    assert [p[-2:] for p in dead] == ["-0", "-1"]  # the first write creates both slots
    alive = SegmentWriter(segment_root(str(tmp_path))).write({"w": torch.ones(8)}, 0)  # this process: alive
    (tmp_path / "unrelated-file").write_text("x")
    assert sorted(sweep_orphans(str(tmp_path))) == dead
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(alive.path), os.path.basename(alive.path)[:-1] + "1", "unrelated-file"])


def test_a_new_sync_sweeps_dead_runs_before_it_writes(tmp_path, ray_put):
    (tmp_path / "asyncrl-weights-999999999-abcd1234-0").write_bytes(b"x")  # no such pid
    SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("choice", "nodes", "expected"),
    [
        ("auto", 1, "shared_memory"),  # every engine on the learner's node
        ("auto", 2, "object_store"),
        ("shared_memory", 1, "shared_memory"),
        ("object_store", 1, "object_store"),
        ("collective", 1, "collective"),  # never picked by auto
        ("collective", 2, "collective"),
    ],
)
def test_auto_picks_shared_memory_only_on_a_single_node(choice, nodes, expected):
    assert resolve_transport(choice, nodes) == expected


def test_the_transport_is_a_config_choice():
    assert WeightSyncConfig().transport == "auto"
    with pytest.raises(ValueError):
        WeightSyncConfig(transport="nccl")


def test_rewire_restages_the_served_version_in_the_new_learners_segment_and_waits_for_it(tmp_path, ray_put):
    """The old rank 0 unlinked its slots when it stopped; the new one writes the version the engines serve
    (waited for, as a first export is) so an engine joining later maps a slot that holds it."""
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    sync.finish(sync.start(1))
    sync.finish(sync.start(2))
    sync.learner.writer.close()  # what the old rank 0's shutdown does
    new = FakeLearner()
    sync.rewire(new, 2)
    assert new.calls == [("export_shared", 2)] and len(sync.rollout.started) == 2
    (record,) = sync.latest().refs
    assert record.version == 2 and record.path == sync.root + "-0" and os.path.exists(record.path)
    sync.finish(sync.start(3))
    assert new.calls[-2:] == [("start_export_shared", 3), ("finish_call", 3)]
    sync.shutdown()
