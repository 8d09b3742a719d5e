"""The megatron backend's train state on one rank: the policy (`model.MegatronPolicy`, this rank's TP piece), torch's
AdamW over its parameters and the learning-rate schedule (`asyncrl.learner.state.lr_factor`), the same
`TrainState` record the FSDP2 backend fills; its gradient reduction and its checkpoints.

Ranks: megatron's TP groups are `tensor_parallel` consecutive ranks; the data-parallel groups run across them. The
ranks of one TP group get the same rows (`LearnerPool`), so every statistic the step sums over ranks is summed over
the data-parallel group only (`data_parallel_all_reduce`).

Gradient reduction (architecture invariant 5, as with FSDP2): the per-token weights already divide by the whole
batch's denominators, so the batch gradient is the SUM of the data-parallel ranks' gradients (`clip_grad_norm_`
sums them, then clips). Without sequence parallelism megatron's layers already all-reduce the activations' gradients
over the TP group, so a parameter that every TP rank holds whole (norms, a row-parallel layer's bias) has the same
gradient on each, and the norm counts it once: sqrt(sum over TP of the split parameters' squares + the whole ones').
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.learner.megatron.model import MegatronPolicy, build_gpt, init_parallel, partition_dim

__all__ = [
    "build_megatron_reference",
    "build_megatron_train_state",
    "clip_grad_norm_",
    "data_parallel_all_reduce",
    "load_megatron_state",
    "save_megatron_state",
]


def build_megatron_train_state(cfg, model_dir: str, device: torch.device, compute_dtype: torch.dtype = torch.float32):
    """The policy of `model_dir` as megatron's `GPTModel` split over `cfg.tensor_parallel` ranks (the process group
    must be up), fp32 master weights whose decoder layers compute in `compute_dtype` (`model.MegatronPolicy`), with
    AdamW and its schedule. Unsupported learner settings (a critic, compile, activation
    checkpointing, routing replay) are refused by `LearnerConfig`."""
    from asyncrl.learner.checkpoint import TrainState
    from asyncrl.learner.policy import load_causal_lm
    from asyncrl.learner.state import lr_factor, materialize_optimizer_state

    init_parallel(cfg.tensor_parallel, cfg.seed)
    causal_lm = load_causal_lm(model_dir, torch.float32)
    policy = MegatronPolicy(build_gpt(causal_lm.config, cfg.tensor_parallel), causal_lm.config, compute_dtype)
    policy.load_hf_state(causal_lm.state_dict())
    del causal_lm
    policy.to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    materialize_optimizer_state(optimizer)
    return TrainState(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg)))


def data_parallel_all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`asyncrl.learner.step.AllReduce` over this rank's data-parallel group (its TP peers hold the same rows)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.all_reduce(
        tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=ps.get_data_parallel_group()
    )
    return tensor


def clip_grad_norm_(policy: MegatronPolicy, max_norm: float) -> torch.Tensor:
    """Sum the gradients over the data-parallel group, then clip them to a global norm of `max_norm` as
    `torch.nn.utils.clip_grad_norm_` does (scale by max_norm / (norm + 1e-6) when that is below 1); -> the pre-clip
    norm of the whole (unsplit) gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pairs = [(p, p.grad) for p in policy.parameters() if p.grad is not None]
    grads = [g for _, g in pairs]
    if ps.get_data_parallel_world_size() > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ps.get_data_parallel_group())
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))
    split = [g for p, g in pairs if partition_dim(p) is not None]
    whole = [g for p, g in pairs if partition_dim(p) is None]
    squares = torch.stack([_sum_sq(split), _sum_sq(whole)])
    if ps.get_tensor_model_parallel_world_size() > 1:
        split_sq = squares[:1].clone()
        dist.all_reduce(split_sq, group=ps.get_tensor_model_parallel_group())
        squares[0] = split_sq[0]
    total = squares.sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _sum_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()


# ---------------------------------------------------------------------- checkpoints

_DCP_DIR = "learner"


def _piece_file(folder: Path, tp_rank: int) -> Path:
    return folder / _DCP_DIR / f"megatron_tp{tp_rank}.pt"


def save_megatron_state(folder: str, state, rank: int, step: int) -> None:
    """Collective: the first data-parallel rank of each TP rank writes its piece of the model and of AdamW's state
    (`learner/megatron_tp<r>.pt`); every rank its RNG and schedule (`learner/rank_<r>.pt`, as the FSDP2 backend)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.learner.checkpoint import _rng_state

    path = Path(folder) / _DCP_DIR
    path.mkdir(parents=True, exist_ok=True)
    if ps.get_data_parallel_rank() == 0:
        piece = {
            "model": state.policy.state_dict(),
            "optim": state.optimizer.state_dict(),
            "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
        }
        torch.save(piece, _piece_file(Path(folder), ps.get_tensor_model_parallel_rank()))
    torch.save({"rng": _rng_state(), "scheduler": state.scheduler.state_dict(), "step": step}, path / f"rank_{rank}.pt")
    dist.barrier()


def load_megatron_state(folder: str, state, rank: int) -> int:
    """Collective: load this rank's piece of the model and AdamW's state, the schedule and (where the rank existed)
    its RNG; -> the saved step. The checkpoint must come from the same `learner.tensor_parallel`."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.checkpoint import _set_rng_state

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    file = _piece_file(Path(folder), tp_rank)
    if not file.exists():
        raise FileNotFoundError(
            f"{folder}: no megatron checkpoint piece {file.name} (written by learner.training_backend = megatron; "
            f"`asyncrl convert-checkpoint --to megatron` converts an FSDP2 one)"
        )
    piece = torch.load(file, weights_only=True)  # nothing unpickled from a user path
    if piece["tensor_parallel"] != tp:
        raise ValueError(
            f"{folder}: written with learner.tensor_parallel = {piece['tensor_parallel']}, resumed with {tp} "
            f"(`asyncrl convert-checkpoint --to megatron --tensor-parallel {tp}` converts it)"
        )
    state.policy.load_state_dict(piece["model"], strict=True)
    state.optimizer.load_state_dict(piece["optim"])
    local_file = Path(folder) / _DCP_DIR / f"rank_{rank}.pt"
    restore_rng = local_file.exists()
    local = torch.load(local_file if restore_rng else local_file.with_name("rank_0.pt"), weights_only=True)
    state.scheduler.load_state_dict(local["scheduler"])
    if restore_rng:
        _set_rng_state(local["rng"])
    return int(local["step"])


def build_megatron_reference(
    model_dir: str, tensor_parallel: int, device: torch.device, compute_dtype: torch.dtype = torch.float32
) -> MegatronPolicy:
    """The frozen reference policy of the KL-to-reference term, split and computing like the policy: eval mode, no
    gradients, no optimizer."""
    from asyncrl.learner.policy import load_causal_lm

    causal_lm = load_causal_lm(model_dir, torch.float32)
    reference = MegatronPolicy(build_gpt(causal_lm.config, tensor_parallel), causal_lm.config, compute_dtype)
    reference.load_hf_state(causal_lm.state_dict())
    reference.requires_grad_(False)
    return reference.to(device).eval()
