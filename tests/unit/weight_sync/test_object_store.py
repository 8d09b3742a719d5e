"""ObjectStoreSync with hand-written fakes of the learner and rollout pools: what is exported and sent, the
latest weights, the result record, and the overlap / parity-probe policy."""

import time

import pytest

from asyncrl.config import WeightSyncConfig
from asyncrl.rollout.pool import WeightSyncError
from asyncrl.weight_sync.object_store import ObjectStoreSync
from asyncrl.weights.published import ExportedWeights


class FakeLearner:
    def __init__(self):
        self.exports = []

    def export_weights(self, bucket_bytes):
        self.exports.append(bucket_bytes)
        return ExportedWeights(refs=[f"bucket-{len(self.exports)}-{i}" for i in range(3)], num_bytes=1000, num_tensors=7)


class FakeRollout:
    """Records the engine-side calls; `fail` makes the wait raise as the real pool does."""

    def __init__(self, fail: str | None = None, served_after_s: float | None = None):
        self.started, self.finished, self.fail, self.served_after_s = [], [], fail, served_after_s

    def start_update(self, refs, version, in_flight):
        self.started.append((list(refs), version, in_flight))
        self.began = time.time()
        return {f"call-{version}": "rollout-0"}

    def finish_update(self, calls, version, timeout_s):
        if self.fail:
            raise WeightSyncError(f"weight sync failed: {self.fail} did not confirm version {version}")
        self.finished.append((calls, version, timeout_s))
        return None if self.served_after_s is None else self.began + self.served_after_s


def make_sync(mode="streaming", rollout=None, **config):
    config = WeightSyncConfig(**{"bucket_bytes": 1 << 16, "timeout_s": 9.0, **config})
    return ObjectStoreSync(FakeLearner(), rollout or FakeRollout(), config, mode)


def test_start_exports_sends_the_buckets_to_the_engines_and_becomes_the_latest():
    sync = make_sync()
    assert sync.latest() is None
    pending = sync.start(4)
    assert sync.learner.exports == [1 << 16]
    assert sync.rollout.started == [(["bucket-1-0", "bucket-1-1", "bucket-1-2"], 4, True)]
    assert pending.version == 4 and pending.calls == {"call-4": "rollout-0"}
    # A worker started before the engines confirm must already get version 4.
    assert sync.latest().version == 4 and sync.latest().refs == ["bucket-1-0", "bucket-1-1", "bucket-1-2"]


def test_finish_waits_with_the_configured_timeout_and_reports_the_sizes():
    sync = make_sync()
    result = sync.finish(sync.start(1))
    assert sync.rollout.finished == [({"call-1": "rollout-0"}, 1, 9.0)]
    assert (result.version, result.num_bytes, result.num_tensors, result.num_buckets) == (1, 1000, 7, 3)
    assert result.seconds >= 0.0


@pytest.mark.parametrize(("served_after_s", "low", "high"), [(0.05, 0.05, 0.07), (-5.0, 0.0, 0.02), (60.0, 0.2, 0.3)])
def test_a_syncs_seconds_end_when_the_last_engine_began_serving_not_when_the_controller_collects(served_after_s, low, high):
    """The controller collects an overlapped sync after its next step (here 0.2 s later): the engines' own stamp
    ends the sync, kept between the export's start and the collection (engines on other nodes have other clocks)."""
    sync = make_sync(rollout=FakeRollout(served_after_s=served_after_s))
    pending = sync.start(1)
    time.sleep(0.2)
    assert low <= sync.finish(pending).seconds <= high


def test_a_failed_engine_fails_the_sync_naming_it_and_the_weights_stay_the_latest():
    sync = make_sync(rollout=FakeRollout(fail="rollout-3"))
    pending = sync.start(2)
    with pytest.raises(WeightSyncError, match="rollout-3 did not confirm version 2"):
        sync.finish(pending)
    assert sync.latest().version == 2  # a replacement engine loads them


def test_sync_mode_never_loads_in_flight_and_a_resume_drains_in_any_mode():
    sync_mode = make_sync(mode="sync")
    sync_mode.start(1)
    streaming = make_sync(mode="streaming")
    streaming.start(1, in_flight=False)
    assert sync_mode.rollout.started[0][2] is False and streaming.rollout.started[0][2] is False


@pytest.mark.parametrize(
    "mode, in_flight, overlap, expected",
    [("streaming", True, True, True), ("sao", True, True, True), ("sync", True, True, False),
     ("streaming", False, True, False), ("streaming", True, False, False)],
)
def test_a_sync_overlaps_the_next_step_only_when_engines_load_in_flight_and_overlap_is_on(mode, in_flight, overlap, expected):
    assert make_sync(mode=mode, in_flight=in_flight, overlap=overlap).overlaps() is expected


def test_parity_is_probed_after_the_first_sync_and_every_kth_one():
    sync = make_sync(parity_probe_every=10)
    assert [v for v in range(1, 31) if sync.probes(v)] == [1, 10, 20, 30]
    assert not any(make_sync(parity_probe=False).probes(v) for v in range(1, 31))


def test_rewire_publishes_the_served_version_from_the_new_learner_without_sending_it():
    """A re-formed learner pool: `latest()` must be refs the new rank 0 owns (the old one's died with it), and
    no engine loads anything (they already serve that version)."""
    sync = ObjectStoreSync(FakeLearner(), FakeRollout(), WeightSyncConfig(), "streaming")
    sync.finish(sync.start(4))
    new = FakeLearner()
    sync.rewire(new, 4)
    assert sync.learner is new and new.exports == [WeightSyncConfig().bucket_bytes]
    assert sync.latest().version == 4 and sync.latest().refs == ["bucket-1-0", "bucket-1-1", "bucket-1-2"]
    assert len(sync.rollout.started) == 1  # only the sync of version 4 itself
    sync.finish(sync.start(5))
    assert len(new.exports) == 2 and sync.rollout.started[-1][1] == 5
