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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "RankMemory",
    "check_rank_memory",
    "forward_backward_peak",
    "held_bytes",
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


def rank_need(
    shapes: list[tuple[int, ...]], num_ranks: int, reference: list[tuple[int, ...]] | None = None
) -> RankMemory:
    """The train state of rank 0 when `num_ranks` ranks shard tensors of `shapes` (and the frozen `reference`
    policy's, when given) (module docstring)."""
    shard = _share(shapes, num_ranks)
    total = sum(math.prod(s) for s in shapes)
    return RankMemory(num_ranks, total, shard, shard, 2 * shard, total * _FP32, _share(reference or [], num_ranks))


def _share(shapes: list[tuple[int, ...]], num_ranks: int) -> int:
    """fp32 bytes of rank 0's shard of tensors of `shapes`."""
    return sum(math.ceil(s[0] / num_ranks) * math.prod(s[1:]) if s else 1 for s in shapes) * _FP32


def check_rank_memory(cfg, model_dir: str, reference: bool = False) -> RankMemory | None:
    """`learner.rank_memory_gb` against `rank_need` of `model_dir` at `learner.num_ranks` (a `LearnerConfig`), with
    the reference policy (`learner.reference_path`, default `model_dir`) when `reference` (the recipe's
    `kl_coef` > 0); raises naming the figures and the smallest number of ranks that fits. None when no budget."""
    if cfg.rank_memory_gb is None:
        return None
    shapes = parameter_shapes(model_dir, cfg.critic)
    ref = parameter_shapes(cfg.reference_path or model_dir) if reference else None
    need, budget = rank_need(shapes, cfg.num_ranks, ref), cfg.rank_memory_gb * 1e9
    if need.need <= budget:
        return need
    raise ValueError(
        f"learner.rank_memory_gb = {cfg.rank_memory_gb:g} is too small for {model_dir} with learner.num_ranks = "
        f"{cfg.num_ranks}: each rank needs {_gb(need.need)} GB ({need.parameters:,} fp32 parameters"
        f"{' with the critic' if cfg.critic else ''}: {_gb(need.params)} GB of parameters + {_gb(need.grads)} of "
        f"gradients + {_gb(need.optimizer)} of AdamW moments"
        f"{f' + {_gb(need.reference)} of the reference policy' if ref else ''} per rank; every rank first loads the "
        f"whole model, {_gb(need.load)} GB); activations come on top. "
        f"{_fewest_ranks(shapes, cfg.num_ranks, budget, ref)}"
    )


def _fewest_ranks(
    shapes: list[tuple[int, ...]], num_ranks: int, budget: float, reference: list[tuple[int, ...]] | None
) -> str:
    floor = rank_need(shapes, 1).load
    if floor > budget:
        return f"No number of ranks fits: loading the whole fp32 model takes {_gb(floor)} GB on every rank."
    n = num_ranks + 1
    while rank_need(shapes, n, reference).need > budget:
        n += 1
    return f"It fits from learner.num_ranks = {n} ({_gb(rank_need(shapes, n, reference).need)} GB per rank)."


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
