"""Weight export, learner side: the policy's full state dict under Hugging Face names, packed into buckets.

Every rank takes part in gathering the full state dict; rank 0 converts it to Hugging Face names (tied
`lm_head.weight` included explicitly) and packs safetensors buckets (`asyncrl.weights.buckets.pack_buckets`)
or, for the shared-memory transport, copies it into a segment (`asyncrl.weights.segment`).
How the buckets reach the engines is the weight sync's business (`asyncrl.weight_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asyncrl.learner.policy import hf_name
from asyncrl.weights.published import ExportedWeights

__all__ = ["cast_state", "checkpoint_layout", "hf_state_dict", "pack_state_dict", "put_buckets"]


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
