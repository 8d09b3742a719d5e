"""`StagedSync`: the part the shared-memory and collective transports share.

Both have learner rank 0 stage the full, Hugging Face-named state under a layout fixed by the first export
(a /dev/shm slot, or a staging buffer engines pull from over their own process group) and hand the engines a
small record through Ray instead of the weights. Only the first export is waited for: it fixes the layout,
hence the record's sizes. Later ones are submitted to the learner ranks and the engines are handed rank 0's
pending result at once, so the controller goes on to its next batch and `train_step` while rank 0 stages;
the ranks run the export before that `train_step` (a Ray actor runs one caller's calls in order), and each
engine waits for the record before it pauses to load. `finish` collects the export, naming a failed rank.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from asyncrl.weight_sync.base import PendingSync
from asyncrl.weight_sync.object_store import ObjectStoreSync
from asyncrl.weights.published import PublishedWeights

if TYPE_CHECKING:
    from asyncrl.weight_sync.ends import ExportCall

__all__ = ["StagedSync"]


class StagedSync(ObjectStoreSync):
    """Publishes rank 0's record of a staged version (through the object store, a few kB)."""

    _sizes: tuple[int, int] | None = None
    """(payload bytes, tensors) of every version, fixed by the first export."""

    @abstractmethod
    def _export(self, version: int) -> Any:
        """Stage `version` and wait: -> rank 0's record (`num_bytes`, `num_tensors`)."""

    @abstractmethod
    def _start_export(self, version: int) -> ExportCall:
        """Stage `version` without waiting: `refs[0]` resolves to rank 0's record."""

    def start(self, version: int, in_flight: bool | None = None) -> PendingSync:
        """The first sync waits for its export (it learns the sizes); later ones do not (module docstring)."""
        if self._sizes is None:
            return super().start(version, in_flight)
        began = time.time()
        export = self._start_export(version)
        return self._send(PublishedWeights(version, [export.refs[0]], *self._sizes), began, in_flight, export)

    def _publish(self, version: int) -> PublishedWeights:
        import ray

        record = self._export(version)
        self._sizes = (record.num_bytes, record.num_tensors)
        return PublishedWeights(version, [ray.put(record)], *self._sizes)
