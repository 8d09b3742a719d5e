"""CollectiveSync with hand-written fakes: what the learner is asked for, what the engines are handed, and the
loopback choice (the wire itself: tests/unit/weights/test_group.py; a real engine: tests/integration/test_weight_sync_collective.py)."""

import pytest

from asyncrl.config import WeightSyncConfig
from asyncrl.learner.pool import LearnerCall, LearnerCallError
from asyncrl.weight_sync.collective import CollectiveSync
from asyncrl.weights.group import CollectiveWeights
from tests.unit.weight_sync.fakes import FakeRollout


class FakeLearner:
    """Stands for learner rank 0: an export returns the record at once (a started one, as its object ref)."""

    def __init__(self, fail_export=False):
        self.calls = []
        self.fail_export = fail_export

    def export_collective(self, version, loopback, bucket_bytes, timeout_s):
        self.calls.append(("export_collective", version, loopback, bucket_bytes, timeout_s))
        return CollectiveWeights(version, "127.0.0.1" if loopback else "10.0.0.1", "tcp://10.0.0.1:29500", "gloo", 72, 2, bucket_bytes, timeout_s)

    def start_export_collective(self, version, loopback, bucket_bytes, timeout_s):
        record = self.export_collective(version, loopback, bucket_bytes, timeout_s)
        self.calls[-1] = ("start_export_collective", *self.calls[-1][1:])
        return LearnerCall("export_collective", [record], 0.0)

    def finish_call(self, call):
        self.calls.append(("finish_call", call.refs[0].version))
        if self.fail_export:
            raise LearnerCallError("learner rank 0: export_collective failed: out of memory")
        return call.refs


def _sync(loopback=True, fail_export=False):
    config = WeightSyncConfig(transport="collective", bucket_bytes=1 << 20, timeout_s=30.0)
    return CollectiveSync(FakeLearner(fail_export), FakeRollout(), config, "streaming", loopback=loopback)


def test_the_first_export_is_waited_for_and_the_engines_get_one_record(ray_put):
    sync = _sync()
    result = sync.finish(sync.start(1))
    assert sync.learner.calls == [("export_collective", 1, True, 1 << 20, 30.0)]
    [(refs, version, in_flight)] = sync.rollout.started
    assert (version, in_flight, len(refs)) == (1, True, 1)
    assert (refs[0].host, refs[0].version, refs[0].bucket_bytes) == ("127.0.0.1", 1, 1 << 20)
    assert (result.num_bytes, result.num_tensors, result.num_buckets) == (72, 2, 1)
    assert sync.latest().refs == refs  # a joining engine pulls the same record


def test_later_exports_are_handed_to_the_engines_pending_and_collected_by_finish(ray_put):
    sync = _sync(loopback=False)
    sync.finish(sync.start(1))
    pending = sync.start(2)
    assert [c[:3] for c in sync.learner.calls] == [("export_collective", 1, False), ("start_export_collective", 2, False)]
    assert sync.rollout.started[-1][0][0].host == "10.0.0.1"  # several nodes: the learner node's address
    sync.finish(pending)
    assert sync.learner.calls[-1] == ("finish_call", 2)


def test_a_failed_export_is_named_by_finish(ray_put):
    sync = _sync(fail_export=True)
    sync.finish(sync.start(1))  # the first export is not a started call here: nothing to fail
    with pytest.raises(LearnerCallError, match="rank 0: export_collective failed"):
        sync.finish(sync.start(2))


def test_the_record_on_the_wire_names_the_engines_group_and_leaves_the_actor_handle_out():
    import json

    record = CollectiveWeights(3, "127.0.0.1", "tcp://127.0.0.1:29500", "gloo", 72, 2, 1 << 20, 30.0, sender=object())
    assert json.loads(record.to_wire("rollout-2-ab12")) == {
        "key": "rollout-2-ab12", "version": 3, "host": "127.0.0.1", "store": "tcp://127.0.0.1:29500", "backend": "gloo", "bucket_bytes": 1 << 20, "timeout_s": 30.0,
        "gpu": "",
    }  # fmt: skip


def test_rewire_stages_the_served_version_on_the_new_rank_0_and_sends_nothing(ray_put):
    """After a learner resize the record names the new rank 0's store: an engine's next pull opens a group
    with it (`CollectiveReceiver` reopens when the address of a key changes)."""
    sync = _sync()
    sync.finish(sync.start(3))
    new = FakeLearner()
    sync.rewire(new, 3)
    assert sync.learner is new and new.calls == [("export_collective", 3, True, 1 << 20, 30.0)]
    assert len(sync.rollout.started) == 1 and sync.latest().version == 3
