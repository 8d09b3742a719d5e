"""`AdapterSync`: only the policy's LoRA adapter travels (`learner.lora`), whatever `weight_sync.transport` says.

The base model never changes in a LoRA run: every engine loaded it at start. At each sync learner rank 0 gathers
the adapters alone (`LearnerPool.export_adapter`: PEFT-named safetensors bytes, a few MB where the model is GB),
which go through the Ray object store to every engine; the engine writes them into its adapter folder and vLLM
loads them in place under the new version (`asyncrl.rollout.vllm_compat.adapter`), running requests included, so
per-token versions stay right as with an in-place weight load. An engine started later loads `latest()`, the
last adapter, before it serves. The record's bytes are the sync's `num_bytes`.
"""

from __future__ import annotations

import ray

from asyncrl.weight_sync.object_store import ObjectStoreSync
from asyncrl.weights.published import PublishedWeights

__all__ = ["AdapterSync"]


class AdapterSync(ObjectStoreSync):
    def _publish(self, version: int) -> PublishedWeights:
        """Export the learner's adapters as `version`: one record in the object store."""
        record = self.learner.export_adapter()
        return PublishedWeights(version, [ray.put(record)], record.num_bytes, record.num_tensors)
