"""`DeltaSync`: the object-store transport sending only what changed since the version the engines serve
(`weight_sync.delta: true`, full fine-tuning).

Learner rank 0 keeps the last version it sent in the engines' dtype and puts in the object store only the
tensors whose bits changed, each dense or as indices + values, whichever is smaller (`LearnerPool.export_delta`;
the format, its digests and its exactness are `asyncrl.weights.delta`). Each engine's worker keeps the state it
serves (`vllm_compat.WeightReceiver`: one more copy of the weights in the engine's memory), applies the delta,
checks the learner's digest of the result, and loads the changed tensors in place (or the whole state, for
engines that reload).

Full payloads: the first sync, `rewire`, and `latest()` (what an engine that joins or replaces a dead one
loads), which rank 0 builds from its copy of that version without a gather. An engine that cannot apply a
delta (it missed a version; its state's digest differs from the learner's) fails its load with
`weights.delta.BASE_MISMATCH`; `finish` then sends every engine the full version and waits again (an engine
that already serves it loads it once more), and counts it in `resyncs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.weight_sync.base import PendingSync, SyncResult
from asyncrl.weight_sync.object_store import ObjectStoreSync
from asyncrl.weights.delta import BASE_MISMATCH
from asyncrl.weights.published import PublishedWeights

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.weight_sync.ends import WeightLoaders, WeightPublisher

__all__ = ["DeltaSync"]


class DeltaSync(ObjectStoreSync):
    """`ObjectStoreSync` publishing deltas; `latest()` is the full version, built when first asked for."""

    def __init__(self, learner: WeightPublisher, rollout: WeightLoaders, config: WeightSyncConfig, mode: Mode):
        super().__init__(learner, rollout, config, mode)
        self._full: PublishedWeights | None = None
        """The full payload of `_latest.version`, once an engine needed it."""
        self.resyncs = 0
        """Syncs that fell back to the full version because an engine could not apply the delta."""

    def _publish(self, version: int, full: bool = False) -> PublishedWeights:
        exported = self.learner.export_delta(version, self.config.bucket_bytes, full or self._latest is None)
        self._full = None
        return PublishedWeights(version, exported.refs, exported.num_bytes, exported.num_tensors)

    def latest(self) -> PublishedWeights | None:
        if self._latest is None:
            return None
        if self._full is None or self._full.version != self._latest.version:
            version = self._latest.version
            exported = self.learner.export_delta_base(version, self.config.bucket_bytes)
            self._full = PublishedWeights(version, exported.refs, exported.num_bytes, exported.num_tensors)
        return self._full

    def finish(self, pending: PendingSync) -> SyncResult:
        try:
            return super().finish(pending)
        except RuntimeError as e:
            if BASE_MISMATCH not in str(e):
                raise
        self.resyncs += 1
        full = self.latest()
        assert full is not None and full.version == pending.version, "a full resync of a version no longer latest"
        calls = self.rollout.start_update(full.refs, full.version, self.in_flight)
        return pending.confirmed(self.rollout.finish_update(calls, full.version, self.config.timeout_s))

    def rewire(self, learner: WeightPublisher, version: int) -> None:
        self.learner = learner
        self._latest = self._publish(version, full=True)
