"""The weight transport format shared by the learner (publisher) and the rollout engines (receivers).

Weights travel as a list of *buckets*: each bucket is one safetensors-serialized dict mapping Hugging Face
parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...) to tensors. Bytes, not
tensors, cross the process boundaries (Ray object store, vLLM `collective_rpc`): vLLM's RPC serializer does
not carry torch tensors reliably, and a bytes blob is put into the object store once for every engine.

Tied models (`tie_word_embeddings`) send `lm_head.weight` explicitly next to `model.embed_tokens.weight`:
the receiving engine checks nothing about tying, and a reload that misses the head silently keeps the old one.

This module imports only torch and safetensors (the learner side uses it without vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save


def hf_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of a Hugging Face model under its checkpoint name, tied ones included.

    `named_parameters()` drops the second name of a shared parameter (`lm_head.weight` of a tied model);
    `remove_duplicate=False` keeps it. Sharded (DTensor) parameters are gathered to full tensors.
    """
    for name, param in model.named_parameters(remove_duplicate=False):
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # torch.distributed DTensor (FSDP2)
            tensor = tensor.full_tensor()
        yield name, tensor


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[bytes]:
    """Serialize tensors into safetensors buckets whose payload is at most `bucket_bytes` each.

    Tensors keep their dtype; buckets follow the input order (inside a bucket safetensors orders names). A single
    tensor larger than `bucket_bytes` gets a bucket of its own (tensors are never split). The bound is on tensor
    payload; each bucket adds a small JSON header.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive (got {bucket_bytes})")
    buckets: list[bytes] = []
    current: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # storage pointers in `current`
    current_bytes = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            buckets.append(_st_save(current))
        current, current_bytes = {}, 0
        storages.clear()

    for name, tensor in named_tensors:
        if name in current:
            raise ValueError(f"tensor {name!r} appears twice")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > bucket_bytes:
            flush()
        # safetensors refuses two names sharing storage (tied embeddings): give the second its own copy.
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        current[name] = tensor
        current_bytes += size
    flush()
    return buckets


def unpack_bucket(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of one bucket, by Hugging Face name (CPU tensors, dtype as sent)."""
    return _st_load(bytes(data))


def bucket_names(buckets: Iterable[bytes]) -> list[str]:
    """All tensor names in a list of buckets (for checks and error messages)."""
    return [name for data in buckets for name in unpack_bucket(data)]
