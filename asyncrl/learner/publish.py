"""Weight publication, sending side: learner rank 0 -> rollout engines.

On CPU (and as the portable default) weights travel through the Ray object store: every rank takes part
in gathering the full state dict, rank 0 converts it to Hugging Face names (tied `lm_head.weight`
included explicitly), packs safetensors buckets (`asyncrl.rollout.weights.pack_buckets`) and `ray.put`s
each one; the controller hands the refs to the rollout pool, which loads them into every engine.

`WeightPublisher` is the seam for other transports: an NCCL broadcast into vLLM's native weight-transfer
API on GPU implements the same `publish(version) -> WeightUpdate` without changing the controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from asyncrl.learner.policy import hf_name
from asyncrl.types import WeightUpdate

if TYPE_CHECKING:
    from asyncrl.config import WeightSyncConfig
    from asyncrl.learner.worker import LearnerPool

__all__ = ["ExportedWeights", "ObjectStorePublisher", "RolloutWeightSink", "WeightPublisher", "hf_state_dict", "pack_state_dict"]


class WeightPublisher(Protocol):
    def publish(self, version: int) -> WeightUpdate:
        """Send the learner's current weights to every engine as policy `version`; returns once every
        engine reports the version, raises naming the engine otherwise (invariant 7)."""
        ...


class RolloutWeightSink(Protocol):
    """What the publisher needs of the rollout pool (`asyncrl.rollout` implements it)."""

    def update_weights(self, refs: list[Any], version: int, in_flight: bool, timeout_s: float) -> Any: ...


@dataclass
class ExportedWeights:
    """Buckets of one export, put in the Ray object store by learner rank 0."""

    refs: list[Any]  # ray.ObjectRef of safetensors bytes, one per bucket
    num_bytes: int
    num_tensors: int


def hf_state_dict(full_state: Mapping[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The policy's full state dict under Hugging Face names, with `lm_head.weight` present for tied models
    (engines do not re-tie on reload; see rollout/weights.py)."""
    out = {hf_name(k): v for k, v in full_state.items()}
    if tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def pack_state_dict(state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype) -> tuple[list[bytes], int, int]:
    """-> (buckets, payload bytes, number of tensors); floating tensors are cast to the engines' dtype."""
    from asyncrl.rollout.weights import pack_buckets

    named = [(k, v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()]
    num_bytes = sum(v.numel() * v.element_size() for _, v in named)
    return pack_buckets(named, bucket_bytes), num_bytes, len(named)


class ObjectStorePublisher:
    """`WeightPublisher` over the Ray object store (works on CPU and GPU; the only path needed on CPU)."""

    def __init__(self, learner: LearnerPool, rollout: RolloutWeightSink, config: WeightSyncConfig):
        self.learner = learner
        self.rollout = rollout
        self.config = config

    def publish(self, version: int) -> WeightUpdate:
        exported = self.learner.export_weights_info(self.config.bucket_bytes)
        self.rollout.update_weights(exported.refs, version, self.config.in_flight, self.config.timeout_s)
        self.learner.version = version
        return WeightUpdate(
            version=version, num_bytes=exported.num_bytes, num_tensors=exported.num_tensors, num_buckets=len(exported.refs)
        )
