"""AdapterSync with hand-written fakes: only the adapter record travels (whatever `weight_sync.transport`), its
bytes are the sync's, a joining engine gets the last one, and a re-formed learner re-exports without sending."""

import pytest

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.adapter import AdapterSync
from asyncrl.weights.adapter import AdapterWeights

from .test_object_store import FakeRollout


class FakeLearner:
    def __init__(self):
        self.exports = 0

    def export_adapter(self):
        self.exports += 1
        return AdapterWeights(b"x" * (1000 + self.exports), {"r": 4}, num_tensors=56)

    def export_weights(self, bucket_bytes):  # pragma: no cover -- must never be called
        raise AssertionError("a LoRA sync exported the whole weights")


def test_only_the_adapter_travels_and_its_bytes_are_the_syncs(ray_put):
    sync = AdapterSync(FakeLearner(), FakeRollout(), WeightSyncConfig(timeout_s=9.0), "streaming")
    result = sync.finish(sync.start(3))
    [(refs, version, in_flight)] = sync.rollout.started
    assert version == 3 and in_flight and len(refs) == 1 and isinstance(refs[0], AdapterWeights)
    assert (result.version, result.num_bytes, result.num_tensors, result.num_buckets) == (3, 1001, 56, 1)
    assert sync.latest().refs == refs  # an engine started now loads this adapter first


def test_rewire_exports_the_served_adapter_from_the_new_learner_without_sending_it(ray_put):
    sync = AdapterSync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming")
    sync.start(1)
    learner = FakeLearner()
    sync.rewire(learner, 1)
    assert learner.exports == 1 and len(sync.rollout.started) == 1 and sync.latest().version == 1


@pytest.mark.parametrize("transport", ["auto", "shared_memory", "collective", "object_store"])
def test_a_lora_run_syncs_the_adapter_whatever_the_transport(transport, monkeypatch):
    import ray

    from asyncrl.weight_sync.transport import make_weight_sync

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    sync = make_weight_sync(FakeLearner(), FakeRollout(), WeightSyncConfig(transport=transport), "streaming", True)
    assert type(sync) is AdapterSync
