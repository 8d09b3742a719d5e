"""Weight export, learner side: the policy's full state dict under Hugging Face names, packed into buckets.

Every rank takes part in gathering the full state dict; rank 0 converts it to Hugging Face names (tied
`lm_head.weight` included explicitly) and packs safetensors buckets (`asyncrl.weights.buckets.pack_buckets`)
or, for the shared-memory transport, copies it into a segment (`asyncrl.weights.segment`).
How the buckets reach the engines is the weight sync's business (`asyncrl.weight_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncrl.learner.policy import hf_name
from asyncrl.weights.published import ExportedWeights

__all__ = ["cast_state", "checkpoint_layout", "hf_state_dict", "pack_state_dict", "put_buckets", "shard_rows"]


def hf_state_dict(full_state: Mapping[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The policy's full state dict under Hugging Face names, with `lm_head.weight` present for tied models
    (engines do not re-tie on reload; see weights/buckets.py). An engine model without an `lm_head` module, which
    computes its logits from the embedding (vLLM's Gemma 2), leaves that tensor out after checking it equals the
    embedding (`asyncrl.rollout.vllm_compat.weights`)."""
    out = {hf_name(k): v for k, v in full_state.items()}
    if tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def checkpoint_layout(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the in-memory names of `model`, a transformers causal LM) in the layout of the model's checkpoints,
    which engines load: transformers 5 keeps some weights otherwise in memory (an MoE layer's experts fused into 3-D
    `experts.gate_up_proj` and `experts.down_proj`; on disk `experts.<i>.{gate,up,down}_proj.weight`), and reverts
    them with `revert_weight_conversion` when it saves. The same tensors for a model without such conversions (the
    dense families)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, state))


def cast_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in the engines' dtype (no copy when they already are), others as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def pack_state_dict(
    state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype
) -> tuple[list[bytes], int, int]:
    """-> (buckets, payload bytes, number of tensors); floating tensors are cast to the engines' dtype."""
    from asyncrl.weights.buckets import pack_buckets

    named = list(cast_state(state, dtype).items())
    num_bytes = sum(v.numel() * v.element_size() for _, v in named)
    return pack_buckets(named, bucket_bytes), num_bytes, len(named)


def put_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> ExportedWeights:
    """Pack named tensors (as they are) into safetensors buckets and put each in the Ray object store."""
    import ray

    from asyncrl.weights.buckets import pack_buckets

    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    refs = [ray.put(b) for b in pack_buckets(named, bucket_bytes)]
    return ExportedWeights(refs=refs, num_bytes=num_bytes, num_tensors=len(named))


def shard_rows(
    state: Mapping[str, Any], tie_word_embeddings: bool, dtype: torch.dtype, rank: int
) -> dict[str, tuple[int, torch.Tensor]] | None:
    """This rank's rows of every tensor of `state` (a sharded module's state dict) under Hugging Face names:
    (first row in the full tensor, the local rows, floating ones in `dtype`). DTensors sharded on dim 0 of a 1-D
    mesh (FSDP2) give their local shard; plain tensors are rank 0's alone. A tied `lm_head.weight` is the
    embedding's rows again. None when a tensor is sharded otherwise (or padded), so that the caller gathers."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, tuple[int, torch.Tensor]] = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            if value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or value.dim() == 0:
                return None
            local = value.to_local()
            shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            if tuple(local.shape) != tuple(shape):
                return None
            first = offset[0]
        elif rank == 0:
            local, first = value, 0
        else:
            continue
        local = local.detach().to("cpu")
        out[hf_name(name)] = (first, local.to(dtype) if local.is_floating_point() else local)
    if tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
