"""`ObjectStoreSync`: weights through the Ray object store (works on CPU and GPU; the only path on CPU).

Learner rank 0 packs the Hugging Face-named weights into safetensors buckets and `ray.put`s each one
(`LearnerPool.export_weights`); every rollout worker fetches the buckets and loads them into its engine
(`RolloutPool.start_update` / `finish_update`). The buckets stay referenced here until the next sync, so
that a worker started in between loads them too.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from asyncrl.weight_sync.base import PendingSync, SyncResult, WeightSync
from asyncrl.weights.published import PublishedWeights

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.weight_sync.ends import WeightLoaders, WeightPublisher

__all__ = ["ObjectStoreSync"]


class ObjectStoreSync(WeightSync):
    def __init__(self, learner: WeightPublisher, rollout: WeightLoaders, config: WeightSyncConfig, mode: Mode):
        super().__init__(config, mode)
        self.learner = learner
        self.rollout = rollout
        self._latest: PublishedWeights | None = None

    def start(self, version: int, in_flight: bool | None = None) -> PendingSync:
        began = time.time()
        return self._send(self._publish(version), began, in_flight)

    def _send(self, weights: PublishedWeights, began: float, in_flight: bool | None, export=None) -> PendingSync:
        """Start every engine loading `weights`, which become `latest()`."""
        self._latest = weights
        calls = self.rollout.start_update(
            weights.refs, weights.version, self.in_flight if in_flight is None else in_flight
        )
        return PendingSync(weights, calls, began, export)

    def _publish(self, version: int) -> PublishedWeights:
        """Export the learner's weights as `version`, as object refs the engines load."""
        exported = self.learner.export_weights(self.config.bucket_bytes)
        return PublishedWeights(version, exported.refs, exported.num_bytes, exported.num_tensors)

    def finish(self, pending: PendingSync) -> SyncResult:
        if pending.export is not None:
            self.learner.finish_call(pending.export)
        return pending.confirmed(self.rollout.finish_update(pending.calls, pending.version, self.config.timeout_s))

    def latest(self) -> PublishedWeights | None:
        return self._latest

    def rewire(self, learner: WeightPublisher, version: int) -> None:
        self.learner = learner
        self._latest = self._publish(version)
