"""`SharedMemorySync`: weights through one shared-memory segment on the node (no serialization, no object store).

Learner rank 0 gathers the full, Hugging Face-named state and copies it into the slot of the version
(`segment.SegmentWriter`, layout fixed at the first sync); what travels to the engines through Ray is a
small `SharedWeights` record (path, version, layout). Each engine's vLLM worker maps the file and loads from
views of it (`vllm_compat.WeightReceiver.asyncrl_load_shared_weights`): a copy into its parameters, or vLLM's
layerwise `reload_weights`, which re-runs the CPU kernels' weight packing (`rollout.weight_load`). Versions,
pause/resume and parity are the engine's `update_weights` flow, the same as for the object store. Both slots
are created, and their pages faulted in, by the first export.

Only the first export is waited for: it fixes the layout, hence the record's sizes. Later ones are submitted to
the learner ranks and the engines are handed rank 0's pending result at once (`LearnerPool.start_export_shared`),
so the controller goes on to its next batch and `train_step` while rank 0 writes the slot; the ranks run the
export before that `train_step` (a Ray actor runs one caller's calls in order), and each engine waits for the
record before it pauses to load. `finish` collects the export, naming a failed rank.

Every engine must be on the learner's node (`weight_sync.transport: auto` picks this transport only on a
single-node Ray cluster). Segments are unlinked by `shutdown()`, when the driver exits, and, for a driver
that was killed, by the next `SharedMemorySync` on the machine (`sweep_orphans`: the driver's pid is in
the file name).

GPU design (not built: no GPU here). The same seam carries NCCL: `_publish` would, instead of writing a
segment, have learner rank 0 broadcast each full tensor (bucketed, in layout order) over an NCCL group that
includes every engine's worker, and the record sent to the engines would name the group and the version;
the engine side would receive into staging buffers with vLLM's native weight-transfer API
(`update_weights_from_distributed`-style collective RPC) and load them with the same layerwise reload.
The layout record, double-buffered versions, pause -> load -> set version -> resume, and the finish/timeout
logic stay as they are here.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.weight_sync.base import PendingSync, PublishedWeights
from asyncrl.weight_sync.object_store import ObjectStoreSync
from asyncrl.weight_sync.segment import SegmentLayout, slot_path

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool

__all__ = ["SHM_DIR", "SharedMemorySync", "segment_root", "sweep_orphans"]

SHM_DIR = "/dev/shm"
_SEGMENT_NAME = re.compile(r"^asyncrl-weights-(\d+)-[0-9a-f]+-[01]$")


def segment_root(shm_dir: str = SHM_DIR, pid: int | None = None) -> str:
    """A fresh segment root naming the owning process, so that a dead owner's segments can be found."""
    return f"{shm_dir}/asyncrl-weights-{pid or os.getpid()}-{secrets.token_hex(4)}"


def sweep_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the weight segments of processes that no longer exist (a run that was killed); -> their paths."""
    removed = []
    for entry in Path(shm_dir).iterdir():
        match = _SEGMENT_NAME.match(entry.name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
            removed.append(str(entry))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unlink_slots(root: str) -> None:
    for version in (0, 1):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot_path(root, version))


class SharedMemorySync(ObjectStoreSync):
    """Publishes a `SharedWeights` record (through the object store, a few kB) instead of the weights."""

    def __init__(self, learner: LearnerPool, rollout: RolloutPool, config: WeightSyncConfig, mode: Mode, shm_dir: str = SHM_DIR):
        super().__init__(learner, rollout, config, mode)
        sweep_orphans(shm_dir)
        self.root = segment_root(shm_dir)
        self._cleanup = weakref.finalize(self, _unlink_slots, self.root)  # also runs when the driver exits
        self._layout: SegmentLayout | None = None
        """The segments' layout, fixed by the first export (`SegmentWriter`)."""

    def start(self, version: int, in_flight: bool | None = None) -> PendingSync:
        """The first sync waits for its export (it learns the layout); later ones do not (module docstring)."""
        if self._layout is None:
            return super().start(version, in_flight)
        began = time.perf_counter()
        export = self.learner.start_export_shared(self.root, version)
        weights = PublishedWeights(version, [export.refs[0]], self._layout.num_bytes, len(self._layout.places))
        return self._send(weights, began, in_flight, export)

    def _publish(self, version: int) -> PublishedWeights:
        import ray

        shared = self.learner.export_shared(self.root, version)
        self._layout = shared.layout
        return PublishedWeights(version, [ray.put(shared)], self._layout.num_bytes, len(self._layout.places))

    def shutdown(self) -> None:
        self._cleanup()
