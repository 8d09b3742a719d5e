"""A learner rank's memory: what its train state needs, computed from the model's parameter shapes before any rank
starts (`rank_need`, checked against `learner.rank_memory_gb` by `check_rank_memory`), and what a running rank
holds (`held_bytes`, `resident_bytes`).

The train state is fp32 whatever `model.dtype` (master weights, `policy.shard`): per parameter 4 bytes of weight,
4 of gradient and 8 of AdamW moments (`exp_avg`, `exp_avg_sq`). FSDP2 shards every tensor along its first
dimension, padded to a multiple of the ranks, so the largest share (rank 0's) holds ceil(rows / ranks) rows of
each. Before sharding every rank loads the whole fp32 model (`state.build_train_state`): that bounds the need
from below however many ranks share it. With a KL-to-reference term the frozen reference policy adds its fp32
weights, sharded the same way (no gradient, no optimizer state: `state.build_reference`). Not counted, like the
activations: bf16 compute's copies of the decoder layers' weights (under FSDP2 a layer's gathered copy at a time;
on a plain rank `policy.cast_layers` keeps every layer's, 2 bytes per parameter, through the backward).

With `learner.lora` the base model is frozen: its weights count 4 bytes per parameter (sharded), with no gradient
and no AdamW moment; only the adapters (`adapter_shapes`: A [r, in] and B [out, r] per target layer of every block)
and the critic, if any, count 16. The reference policy is the base model with the adapters off (`lora.BaseModelView`,
no second copy) unless `learner.reference_path` names another model.

The megatron backend (`learner.training_backend`, `megatron_rank_need`) splits by `tensor_parallel`, not by
`num_ranks`: its `num_ranks / tensor_parallel` data-parallel replicas each hold a whole TP piece of the parameters,
gradients and AdamW moments (torch's AdamW, no optimizer sharding). A piece holds 1/tensor_parallel of every weight
matrix and of the Q/K/V biases (the vocabulary rows rounded up, as megatron pads them) and every norm whole
(`model._mark_partitions`). Before
taking its piece every rank loads the whole fp32 model and `convert.to_megatron` concatenates its Q/K/V and gate/up
weights into new tensors: `load` counts both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

__all__ = [
    "RankMemory",
    "adapter_shapes",
    "check_rank_memory",
    "forward_backward_peak",
    "held_bytes",
    "megatron_rank_need",
    "parameter_shapes",
    "rank_need",
    "resident_bytes",
]

_FP32 = 4


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs for its train state with `num_ranks` ranks (rank 0's share, the largest)."""

    num_ranks: int
    parameters: int
    """Parameters of the policy (and the critic), unsharded."""
    params: int
    grads: int
    optimizer: int
    load: int
    """The whole fp32 model(s), which every rank loads before sharding."""
    reference: int = 0
    """The frozen reference policy's fp32 weights (its share), 0 without a KL-to-reference term."""
    tensor_parallel: int = 0
    """The megatron backend's split (`megatron_rank_need`); 0 for FSDP2's, over `num_ranks`."""
    frozen: int = 0
    """Of `parameters`, those without gradients or optimizer state (the base model under `learner.lora`)."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer + self.reference

    @property
    def need(self) -> int:
        return max(self.state, self.load)


def parameter_shapes(model_dir: str, critic: bool = False) -> list[tuple[int, ...]]:
    """Shapes of the policy's parameters (tied ones once) and, with `critic`, of the critic's (the trunk and the
    value head, `policy.ValueModel`), read from the model's config on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = [tuple(p.shape) for p in model.parameters()]
    if critic:
        shapes += [tuple(p.shape) for p in model.base_model.parameters()]
        shapes += [(1, config.hidden_size), (1,)]
    return shapes


def adapter_shapes(model_dir: str, lora) -> list[tuple[int, ...]]:
    """Shapes of the adapters `learner.lora` (`lora`: a `LoraConfig`) adds to `model_dir`'s policy: A [r, in] and
    B [out, r] for every target linear layer of every decoder block (`lora.add_adapters`), on the meta device."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.learner.policy import decoder_stack

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    shapes: list[tuple[int, ...]] = []
    for layer in decoder_stack(model)[1]:
        for name, module in layer.named_modules():
            if name.rsplit(".", 1)[-1] in lora.target_modules and isinstance(module, nn.Linear):
                shapes += [(lora.rank, module.in_features), (module.out_features, lora.rank)]
    return shapes


def rank_need(
    shapes: list[tuple[int, ...]],
    num_ranks: int,
    reference: list[tuple[int, ...]] | None = None,
    frozen: list[tuple[int, ...]] | None = None,
) -> RankMemory:
    """The train state of rank 0 when `num_ranks` ranks shard the trained tensors of `shapes`, the `frozen` ones
    (weights only: the base model under `learner.lora`) and the frozen `reference` policy's, when given (module
    docstring)."""
    shard, still = _share(shapes, num_ranks), _share(frozen or [], num_ranks)
    trained, fixed = sum(math.prod(s) for s in shapes), sum(math.prod(s) for s in frozen or [])
    return RankMemory(
        num_ranks, trained + fixed, shard + still, shard, 2 * shard, (trained + fixed) * _FP32,
        _share(reference or [], num_ranks), frozen=fixed,
    )  # fmt: skip


def _share(shapes: list[tuple[int, ...]], num_ranks: int) -> int:
    """fp32 bytes of rank 0's shard of tensors of `shapes`."""
    return sum(math.ceil(s[0] / num_ranks) * math.prod(s[1:]) if s else 1 for s in shapes) * _FP32


_MEGATRON_SPLIT_1D = re.compile(r"\.self_attn\.[qkv]_proj\.bias$")
_MEGATRON_FUSED = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def megatron_rank_need(
    model_dir: str, tensor_parallel: int, num_ranks: int, reference: str | None = None
) -> RankMemory:
    """The train state of one rank of the megatron backend at `tensor_parallel` (module docstring), with the frozen
    reference policy of `reference` (a model folder, split the same way) when given."""
    piece, total, fused = _megatron_piece(model_dir, tensor_parallel)
    ref = _megatron_piece(reference, tensor_parallel)[0] if reference else 0
    return RankMemory(num_ranks, total, piece, piece, 2 * piece, (total + fused) * _FP32, ref, tensor_parallel)


def _megatron_piece(model_dir: str, tensor_parallel: int) -> tuple[int, int, int]:
    """(fp32 bytes of one TP piece, parameters, parameters `convert.to_megatron` copies) of `model_dir`'s policy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        named = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    piece = total = fused = 0
    for name, shape in named:
        numel = math.prod(shape)
        total += numel
        fused += numel if _MEGATRON_FUSED.search(name) else 0
        if len(shape) == 1 and not _MEGATRON_SPLIT_1D.search(name):
            piece += numel  # a norm, whole on every TP rank
        elif name in _VOCAB:
            piece += math.ceil(shape[0] / tensor_parallel) * math.prod(shape[1:])
        else:
            piece += numel // tensor_parallel
    return piece * _FP32, total, fused


def check_rank_memory(cfg, model_dir: str, reference: bool = False) -> RankMemory | None:
    """`learner.rank_memory_gb` against the need of `model_dir` (a `LearnerConfig`'s backend: `rank_need` at
    `learner.num_ranks`, or `megatron_rank_need` at `learner.tensor_parallel`), with the reference policy
    (`learner.reference_path`, default `model_dir`) when `reference` (the recipe's `kl_coef` > 0); raises naming the
    figures and the smallest number of ranks (FSDP2) or tensor-parallel split (megatron) that fits. None when no
    budget."""
    if cfg.rank_memory_gb is None:
        return None
    lora = getattr(cfg, "lora", None)
    if lora is not None and cfg.reference_path is None:
        reference = False  # the base model with the adapters off: no second copy
    budget, ref_dir = cfg.rank_memory_gb * 1e9, (cfg.reference_path or model_dir) if reference else None
    if getattr(cfg, "training_backend", "fsdp2") == "megatron":
        need = megatron_rank_need(model_dir, cfg.tensor_parallel, cfg.num_ranks, ref_dir)
        if need.need <= budget:
            return need
        split = f"learner.training_backend = megatron, learner.tensor_parallel = {cfg.tensor_parallel}"
        raise ValueError(
            _too_small(cfg, model_dir, need, split, _fewest_tensor_parallel(cfg, model_dir, budget, ref_dir))
        )
    shapes, frozen = _trained_and_frozen(cfg, model_dir)
    ref = parameter_shapes(ref_dir) if ref_dir else None
    need = rank_need(shapes, cfg.num_ranks, ref, frozen)
    if need.need <= budget:
        return need
    split = f"learner.num_ranks = {cfg.num_ranks}"
    fits = _fewest_ranks(shapes, cfg.num_ranks, budget, ref, frozen)
    raise ValueError(_too_small(cfg, model_dir, need, split, fits))


def _trained_and_frozen(cfg, model_dir: str) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(shapes with gradients and AdamW moments, frozen shapes) of the FSDP2 backend's train state: everything
    trained, or under `learner.lora` the adapters (and the critic) trained and the policy's base weights frozen."""
    shapes = parameter_shapes(model_dir, cfg.critic)
    lora = getattr(cfg, "lora", None)
    if lora is None:
        return shapes, []
    policy = parameter_shapes(model_dir)
    return adapter_shapes(model_dir, lora) + shapes[len(policy) :], policy


def _too_small(cfg, model_dir: str, need: RankMemory, split: str, fits: str) -> str:
    piece = (
        f" (each of the {cfg.num_ranks // cfg.tensor_parallel} data-parallel replicas holds a whole TP piece)"
        if need.tensor_parallel
        else ""
    )
    load = "and concatenates its Q/K/V and gate/up weights" if need.tensor_parallel else "whole model"
    return (
        f"learner.rank_memory_gb = {cfg.rank_memory_gb:g} is too small for {model_dir} with {split}: each rank "
        f"needs {_gb(need.need)} GB ({need.parameters:,} fp32 parameters{' with the critic' if cfg.critic else ''}"
        f"{_frozen(need)}: "
        f"{_gb(need.params)} GB of parameters + {_gb(need.grads)} of gradients + {_gb(need.optimizer)} of AdamW "
        f"moments{f' + {_gb(need.reference)} of the reference policy' if need.reference else ''} per rank{piece}; "
        f"every rank first loads the {'whole model ' if need.tensor_parallel else ''}{load}, {_gb(need.load)} GB); "
        f"activations come on top. {fits}"
    )


def _frozen(need: RankMemory) -> str:
    if not need.frozen:
        return ""
    return f", {need.frozen:,} of them frozen (learner.lora's base model: weights only, no gradients or moments)"


def _fewest_ranks(
    shapes: list[tuple[int, ...]],
    num_ranks: int,
    budget: float,
    reference: list[tuple[int, ...]] | None,
    frozen: list[tuple[int, ...]] | None = None,
) -> str:
    floor = rank_need(shapes, 1, frozen=frozen).load
    if floor > budget:
        return f"No number of ranks fits: loading the whole fp32 model takes {_gb(floor)} GB on every rank."
    n = num_ranks + 1
    while rank_need(shapes, n, reference, frozen).need > budget:
        n += 1
    return f"It fits from learner.num_ranks = {n} ({_gb(rank_need(shapes, n, reference, frozen).need)} GB per rank)."


def _fewest_tensor_parallel(cfg, model_dir: str, budget: float, reference: str | None) -> str:
    """The smallest `tensor_parallel` above the configured one that divides the attention and key-value heads and
    fits (more ranks do not help: each data-parallel replica holds a whole piece)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    load = megatron_rank_need(model_dir, 1, 1).load
    if load > budget:
        return f"No split fits: every rank first loads the whole fp32 model and its copies, {_gb(load)} GB."
    for tp in range(cfg.tensor_parallel + 1, heads + 1):
        if heads % tp == 0 and kv_heads % tp == 0:
            need = megatron_rank_need(model_dir, tp, tp, reference)
            if need.need <= budget:
                return f"It fits from learner.tensor_parallel = {tp} ({_gb(need.need)} GB per rank)."
    return "No learner.tensor_parallel that divides the attention and key-value heads fits."


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g}"


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def held_bytes(state) -> dict[str, int]:
    """Bytes of this rank's shards of the parameters, gradients (none between steps) and optimizer state of a
    `checkpoint.TrainState`, policy and critic together."""
    modules = [m for m in (state.policy, state.critic) if m is not None]
    optimizers = [o for o in (state.optimizer, state.critic_optimizer) if o is not None]
    params = [p for m in modules for p in m.parameters()]
    moments = [v for o in optimizers for entry in o.state.values() for v in entry.values() if torch.is_tensor(v)]
    return {
        "param_bytes": sum(_local_bytes(p) for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(_local_bytes(v) for v in moments),
    }


def resident_bytes() -> dict[str, int]:
    """This process's resident memory now (`/proc/self/statm`) and its peak so far (`ru_maxrss`, KiB on Linux)."""
    import os
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return {
        "rss_bytes": pages * os.sysconf("SC_PAGE_SIZE"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def forward_backward_peak(policy, input_ids: torch.Tensor) -> dict[str, int]:
    """Peak bytes of one forward + backward of `policy` (a `PolicyModel`) on `input_ids` [B, L] (no padding), by
    kind: `activation` (the forward's tensors and what the autograd graph keeps of them) and `total` (with the
    parameters, gradients and temporaries), as torch's `MemTracker` counts them: every live tensor's storage, on CPU
    the same count every time (what `learner.activation_checkpointing` saves). The gradients are dropped after."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from asyncrl.algo.sampling import RAW

    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    tracker = MemTracker()
    tracker.track_external(policy)
    with tracker:
        policy(input_ids, torch.ones_like(input_ids), positions, RAW).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[input_ids.device]
    policy.zero_grad(set_to_none=True)
    return {"activation": peak[_MemRefType.ACT], "total": peak["Total"]}
