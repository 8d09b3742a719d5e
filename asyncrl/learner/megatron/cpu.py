"""The CPU replacements for megatron-core 0.16's hard-wired CUDA calls, applied (`apply`) only where torch has no
CUDA; nothing here runs on a GPU machine.

What megatron-core assumes that a CPU process lacks, and what stands in for it:

- `torch.cuda.current_device()` as the device of tensors it allocates (`tensor_parallel.layers`, `.mappings`,
  attention, rotary embeddings, `GPTModel`): it returns the CPU device. Without CUDA that call raises, so nothing
  that worked before changes meaning.
- The CUDA RNG tracker that attention and the tensor-parallel layers fork (`tensor_parallel.random`): megatron's own
  no-op tracker (its inference one). The backend runs without dropout, so no random draw happens inside a fork.

Still CUDA-only and not used on CPU: megatron's pipeline schedules (`forward_backward_func`), its optimizer
(`get_megatron_optimizer`) and `model_parallel_cuda_manual_seed` (which `model.init_parallel` calls where there is
CUDA); the CPU step is asyncrl's own micro-batch loop (`asyncrl.learner.step`) with torch's AdamW. tests/gpu/
test_megatron_cuda.py runs megatron's schedule and optimizer on the backend's model and loss on a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["applied", "apply", "without_transformer_engine"]

_APPLIED = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply() -> bool:
    """Install the replacements once, where there is no CUDA; -> whether they are in place."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if not _APPLIED:
        from megatron.core.tensor_parallel import random as mp_random

        torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        _APPLIED = True
    return True


def without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router gating (`transformer.moe.moe_utils`) tests `te_general_gemm is not None` but
    leaves the name undefined when Transformer Engine is not installed (a NameError on the first MoE forward): define
    it as None, the value its own check expects, so the router takes its torch path. Applied with or without CUDA."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def applied() -> bool:
    return _APPLIED
