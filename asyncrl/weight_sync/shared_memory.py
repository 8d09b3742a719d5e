"""`SharedMemorySync`: weights through one shared-memory segment on the node (no serialization, no object store).

Learner rank 0 gathers the full, Hugging Face-named state and copies it into the slot of the version
(`weights.segment.SegmentWriter`, layout fixed at the first sync); from the second sync on, a learner of several
FSDP2 ranks on this node has each rank write its own rows instead, with no gather (`LearnerWorker.export_shared`).
What travels to the engines through Ray is a small `SharedWeights` record (path, version, layout). Each engine's
vLLM worker maps the file and loads from views of it (`vllm_compat.WeightReceiver.asyncrl_load_shared_weights`): a
copy into its parameters, or vLLM's layerwise `reload_weights`, which re-runs the CPU kernels' weight packing
(`rollout.weight_load`). Versions, pause/resume and parity are the engine's `update_weights` flow, the same as for
the object store. Both slots are created, and their pages faulted in, by the first export.

Only the first export is waited for; later ones are handed to the engines pending, and rank 0 writes the slot
while the controller goes on (`staged.StagedSync`, shared with the collective transport).

Every engine must be on the learner's node (`weight_sync.transport: auto` picks this transport only on a
single-node Ray cluster). Segments are unlinked by `shutdown()`, when the driver exits, and, for a driver
that was killed, by the next `SharedMemorySync` on the machine (`sweep_orphans`: the driver's pid is in
the file name).

On several nodes, or on GPU, `weight_sync.transport: collective` (`collective.py`) stages the state the same
way and broadcasts it over a torch.distributed group per engine (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.weight_sync.staged import StagedSync
from asyncrl.weights.segment import SharedWeights, process_alive, slot_path

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.weight_sync.ends import ExportCall, WeightLoaders, WeightPublisher

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
        if match and not process_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
            removed.append(str(entry))
    return removed


def _unlink_slots(root: str) -> None:
    for version in (0, 1):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot_path(root, version))


class SharedMemorySync(StagedSync):
    """Publishes a `SharedWeights` record (through the object store, a few kB) instead of the weights."""

    def __init__(
        self,
        learner: WeightPublisher,
        rollout: WeightLoaders,
        config: WeightSyncConfig,
        mode: Mode,
        shm_dir: str = SHM_DIR,
    ):
        super().__init__(learner, rollout, config, mode)
        sweep_orphans(shm_dir)
        self.root = segment_root(shm_dir)
        self._cleanup = weakref.finalize(self, _unlink_slots, self.root)  # also runs when the driver exits

    def _export(self, version: int) -> SharedWeights:
        return self.learner.export_shared(self.root, version)

    def _start_export(self, version: int) -> ExportCall:
        return self.learner.start_export_shared(self.root, version)

    def shutdown(self) -> None:
        self._cleanup()
