"""DeltaSync with hand-written fakes of the learner and rollout pools: a full export first, deltas after it, the
full version for a joining engine, a full resync when an engine cannot apply a delta, and the config's check."""

import pytest

from asyncrl.config import WeightSyncConfig
from asyncrl.rollout.pool import WeightSyncError
from asyncrl.weight_sync.delta import DeltaSync
from asyncrl.weights.delta import BASE_MISMATCH
from asyncrl.weights.published import ExportedWeights


class FakeLearner:
    def __init__(self):
        self.exports, self.bases = [], []

    def export_delta(self, version, bucket_bytes, full=False):
        self.exports.append((version, full))
        return ExportedWeights(refs=[f"{'full' if full else 'delta'}-{version}"], num_bytes=10 if not full else 1000,
                               num_tensors=2)

    def export_delta_base(self, version, bucket_bytes):
        self.bases.append(version)
        return ExportedWeights(refs=[f"base-{version}"], num_bytes=1000, num_tensors=7)


class FakeRollout:
    """`mismatch`: versions whose delta the engine cannot apply (the wait raises as the real pool does)."""

    def __init__(self, mismatch=()):
        self.started, self.mismatch = [], set(mismatch)

    def start_update(self, refs, version, in_flight):
        self.started.append((list(refs), version))
        return {f"call-{len(self.started)}": "rollout-0"}

    def finish_update(self, calls, version, timeout_s):
        refs = self.started[int(next(iter(calls)).split("-")[1]) - 1][0]
        if version in self.mismatch and refs[0].startswith("delta"):
            raise WeightSyncError(f"weight sync failed: rollout-0 failed to load version {version}: "
                                  f"RuntimeError: {BASE_MISMATCH}: ...")
        return None


def make_sync(rollout=None):
    config = WeightSyncConfig(bucket_bytes=1 << 16, timeout_s=9.0, delta=True, transport="object_store")
    return DeltaSync(FakeLearner(), rollout or FakeRollout(), config, "streaming")


def test_the_first_sync_is_full_later_ones_deltas_and_the_result_counts_the_delta_bytes():
    sync = make_sync()
    assert sync.finish(sync.start(1)).num_bytes == 1000
    assert sync.finish(sync.start(2)).num_bytes == 10
    assert sync.learner.exports == [(1, True), (2, False)]
    assert sync.rollout.started == [(["full-1"], 1), (["delta-2"], 2)]


def test_a_joining_engine_gets_the_full_version_built_once_per_version():
    sync = make_sync()
    assert sync.latest() is None
    sync.finish(sync.start(1))
    sync.finish(sync.start(2))
    assert sync.latest().refs == ["base-2"] and sync.latest().version == 2
    assert sync.learner.bases == [2]  # asked once
    sync.start(3)
    assert sync.latest().refs == ["base-3"] and sync.learner.bases == [2, 3]


def test_an_engine_that_cannot_apply_a_delta_gets_the_full_version():
    sync = make_sync(FakeRollout(mismatch={2}))
    sync.finish(sync.start(1))
    result = sync.finish(sync.start(2))
    assert result.version == 2 and sync.resyncs == 1
    assert sync.rollout.started[-1] == (["base-2"], 2)


def test_other_failures_are_not_resynced():
    class Failing(FakeRollout):
        def finish_update(self, calls, version, timeout_s):
            raise WeightSyncError("weight sync failed: rollout-0 did not confirm version 1 within 9.0s")

    sync = make_sync(Failing())
    with pytest.raises(WeightSyncError, match="did not confirm"):
        sync.finish(sync.start(1))
    assert sync.resyncs == 0


def test_rewire_exports_the_version_in_full_from_the_new_learner():
    sync = make_sync()
    sync.finish(sync.start(1))
    new = FakeLearner()
    sync.rewire(new, 1)
    assert new.exports == [(1, True)] and sync.latest().version == 1


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_delta_refuses_a_transport_other_than_the_object_store(transport):
    with pytest.raises(ValueError, match=f"weight_sync.transport = '{transport}' cannot carry them"):
        WeightSyncConfig(delta=True, transport=transport)
