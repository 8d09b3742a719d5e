"""SharedMemorySync with hand-written fakes, the transport choice, and the clean-up of dead runs' segments."""

import os
import subprocess
import sys

import pytest
import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.segment import SegmentWriter
from asyncrl.weight_sync.shared_memory import SharedMemorySync, segment_root, sweep_orphans
from asyncrl.weight_sync.transport import resolve_transport


class FakeLearner:
    """Writes a real segment, as learner rank 0 does."""

    def __init__(self):
        self.writer = None

    def export_shared(self, root, version):
        self.writer = self.writer or SegmentWriter(root)
        return self.writer.write({"w": torch.full((4, 4), float(version)), "b": torch.zeros(2)}, version)


class FakeRollout:
    def __init__(self):
        self.started = []

    def start_update(self, refs, version, in_flight):
        self.started.append((list(refs), version, in_flight))
        return {f"call-{version}": "rollout-0"}

    def finish_update(self, calls, version, timeout_s):
        pass


@pytest.fixture
def ray_put(monkeypatch):
    """`ray.put` without a cluster: the record itself stands for its object ref."""
    import ray

    monkeypatch.setattr(ray, "put", lambda value: value)


def test_the_engines_get_one_small_record_naming_the_slot_of_the_version(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    result = sync.finish(sync.start(3))
    [(refs, version, in_flight)] = sync.rollout.started
    assert (version, in_flight, len(refs)) == (3, True, 1)
    assert refs[0].path == sync.root + "-1" and refs[0].version == 3
    # payload: 16 + 2 float32 = 72 bytes in 2 tensors and one "bucket" (the record)
    assert (result.num_bytes, result.num_tensors, result.num_buckets) == (72, 2, 1)
    assert sync.latest().refs == refs


def test_shutdown_unlinks_both_slots(tmp_path, ray_put):
    sync = SharedMemorySync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming", shm_dir=str(tmp_path))
    sync.start(1), sync.start(2)
    assert sorted(p.name[-1] for p in tmp_path.iterdir()) == ["0", "1"]
    sync.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_the_segments_of_a_killed_run_are_swept_and_a_live_runs_are_kept(tmp_path):
    # A process that writes a segment under its own pid and is then SIGKILLed: nothing of it cleans up.
    code = (
        "import os, sys, torch; from asyncrl.weight_sync.segment import SegmentWriter;"
        "from asyncrl.weight_sync.shared_memory import segment_root;"
        "SegmentWriter(segment_root(sys.argv[1])).write({'w': torch.ones(8)}, 0); os.kill(os.getpid(), 9)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    [dead] = list(tmp_path.iterdir())
    alive = SegmentWriter(segment_root(str(tmp_path))).write({"w": torch.ones(8)}, 0)  # this process: alive
    (tmp_path / "unrelated-file").write_text("x")
    assert sweep_orphans(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(alive.path), "unrelated-file"])


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
    ],
)
def test_auto_picks_shared_memory_only_on_a_single_node(choice, nodes, expected):
    assert resolve_transport(choice, nodes) == expected


def test_the_transport_is_a_config_choice():
    assert WeightSyncConfig().transport == "auto"
    with pytest.raises(ValueError):
        WeightSyncConfig(transport="nccl")
