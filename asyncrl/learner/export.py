"""Weight export, learner side: the policy's full state dict under Hugging Face names, packed into buckets.

Every rank takes part in gathering the full state dict; rank 0 converts it to Hugging Face names (tied
`lm_head.weight` included explicitly) and packs safetensors buckets (`asyncrl.rollout.weights.pack_buckets`)
or, for the shared-memory transport, copies it into a segment (`asyncrl.weight_sync.segment`).
How the buckets reach the engines is the weight sync's business (`asyncrl.weight_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.learner.policy import hf_name

__all__ = ["ExportedWeights", "cast_state", "hf_state_dict", "pack_state_dict"]


@dataclass(frozen=True)
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


def cast_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in the engines' dtype (no copy when they already are), others as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def pack_state_dict(
    state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype
) -> tuple[list[bytes], int, int]:
    """-> (buckets, payload bytes, number of tensors); floating tensors are cast to the engines' dtype."""
    from asyncrl.rollout.weights import pack_buckets

    named = list(cast_state(state, dtype).items())
    num_bytes = sum(v.numel() * v.element_size() for _, v in named)
    return pack_buckets(named, bucket_bytes), num_bytes, len(named)
