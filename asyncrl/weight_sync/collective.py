"""`CollectiveSync`: weights broadcast over a torch.distributed group per engine (gloo on CPU, NCCL on GPU).

Learner rank 0 gathers the full, Hugging Face-named state and copies it into one staging buffer (layout fixed
by the first export, as for the shared-memory segment: `LearnerPool.export_collective`); what travels to the
engines through Ray is a small `CollectiveWeights` record (version, the sender's store address, backend,
rank 0's actor handle). Each engine then pulls: inside its usual `update_weights` flow (pause -> load -> set
version -> resume) it asks rank 0 to send (`LearnerWorker.send_collective`, in the rank's own send threads,
so the send runs next to the learner's next `train_step`) while its vLLM worker receives into a staging
buffer of its own and loads from it (`vllm_compat.WeightReceiver.asyncrl_receive_collective`). The group,
the layout and both staging buffers are set up by an engine's first pull and reused; the wire is
`weights.group`.

An engine that joins later loads `latest()` the same way, opening its own group; no other group changes.
If the learner staged the next version before such an engine pulled, the engine gets that one and serves
it under its number (never an older one). A failed or timed-out pull fails the engine's load, named by
`finish`, and both sides forget that group; the engine opens a new one at its next pull.

Addresses: on a single-node cluster the groups meet in a file and gloo listens on 127.0.0.1; across nodes
they meet in a `TCPStore` on the learner node's IP (Ray's), port picked free (`group.connect_store`). Engines
may run on any node, so this is the multi-node alternative to the object store (`auto` does not pick it:
docs/architecture.md, "Weight-sync transports", has the measured figures). On GPU the staging
buffers live on the learner's and the engine's CUDA devices and the group is NCCL: the wire ran on one H200,
without Ray or vLLM (benchmarks/RESULTS.md, "W3 wire on a GPU"); an engine on the learner's own GPU refuses,
as NCCL would, but with a reason that names the transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.weight_sync.staged import StagedSync
from asyncrl.weights.group import CollectiveWeights

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.weight_sync.ends import ExportCall, WeightLoaders, WeightPublisher

__all__ = ["CollectiveSync"]


class CollectiveSync(StagedSync):
    """Publishes rank 0's `CollectiveWeights` record; every engine pulls the weights over its own group."""

    def __init__(
        self, learner: WeightPublisher, rollout: WeightLoaders, config: WeightSyncConfig, mode: Mode, loopback: bool
    ):
        super().__init__(learner, rollout, config, mode)
        self.loopback = loopback
        """Every engine runs on the learner's node (a single-node cluster): the groups use 127.0.0.1."""

    def _export(self, version: int) -> CollectiveWeights:
        return self.learner.export_collective(version, self.loopback, self.config.bucket_bytes, self.config.timeout_s)

    def _start_export(self, version: int) -> ExportCall:
        return self.learner.start_export_collective(
            version, self.loopback, self.config.bucket_bytes, self.config.timeout_s
        )
