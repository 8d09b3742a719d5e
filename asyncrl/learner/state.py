"""A rank's train state, built: the policy (and the critic) in fp32, its AdamW optimizer and learning-rate schedule.

Ray-free (torch only), so that a learner step can run without an actor: `LearnerWorker` builds its state here and
shards it with FSDP2; `benchmarks/limits.py` and the GPU tests (tests/gpu) build it on plain modules or one device.
The state's checkpointing is `checkpoint.py`.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable

import torch

__all__ = ["build_reference", "build_train_state", "compile_now", "lr_factor", "materialize_optimizer_state"]


def lr_factor(cfg) -> Callable[[int], float]:
    """The learning-rate multiplier of update `step` (0 = the first) for a `LearnerConfig`: a linear warm-up
    over `warmup_steps`, then `lr_decay` from 1 to `min_lr_ratio`, which it reaches after `max_steps` updates."""
    warmup, total, floor = cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        shape = 1.0 - progress if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * shape

    return factor


def build_train_state(cfg, model_dir: str, device: torch.device, place=lambda module: None):
    """The policy and, with `cfg.critic` (a `LearnerConfig`), the critic: fp32 from `model_dir` on `device`, each
    with `cfg.activation_checkpointing` checkpointed (`policy.checkpoint_layers`), passed to `place` (a rank shards it
    with FSDP2) and, with `cfg.compile`, compiled (`compile_now`), before its AdamW optimizer and learning-rate
    schedule (`lr_factor`) are made."""
    from asyncrl.learner.checkpoint import TrainState
    from asyncrl.learner.policy import PolicyModel, ValueModel, load_causal_lm

    policy = PolicyModel(load_causal_lm(model_dir, torch.float32)).to(device)
    _adapt(cfg, policy)
    _checkpoint_activations(cfg, policy)
    place(policy)
    if cfg.compile:
        compile_now(policy, device)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    materialize_optimizer_state(optimizer)
    state = TrainState(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg)))
    if cfg.critic:
        critic = ValueModel(load_causal_lm(model_dir, torch.float32), seed=cfg.seed).to(device)
        _checkpoint_activations(cfg, critic)
        place(critic)
        if cfg.compile:
            compile_now(critic, device)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, betas=cfg.betas)
        materialize_optimizer_state(critic_optimizer)
        state.critic, state.critic_optimizer = critic, critic_optimizer
        state.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lr_factor(cfg))
    return state


def _adapt(cfg, policy) -> None:
    """`learner.lora`: freeze the policy and attach the adapters (`asyncrl.learner.lora`), before the checkpointing
    and `place`, so that they live inside the decoder layers' FSDP2 units and casts."""
    lora = getattr(cfg, "lora", None)
    if lora is None:
        return
    from asyncrl.learner.lora import add_adapters

    policy.requires_grad_(False)
    add_adapters(policy.decoder_layers, lora, cfg.seed)


def _checkpoint_activations(cfg, module) -> None:
    """`learner.activation_checkpointing`, before `place`: checkpointing goes inside the FSDP2 units and the casts."""
    from asyncrl.learner.policy import checkpoint_layers

    if cfg.activation_checkpointing:
        checkpoint_layers(module)


def build_reference(model_dir: str, device: torch.device, place=lambda module: None):
    """The frozen reference policy of the KL-to-reference term: a `PolicyModel` fp32 from `model_dir` on `device`,
    passed to `place` (sharded like the policy), in eval mode with no parameter requiring a gradient. It has no
    optimizer and is never compiled (its passes are without gradients)."""
    from asyncrl.learner.policy import PolicyModel, load_causal_lm

    reference = PolicyModel(load_causal_lm(model_dir, torch.float32)).to(device)
    reference.requires_grad_(False)
    place(reference)
    return reference.eval()


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state now, equal to a fresh optimizer's.

    torch.distributed.checkpoint's `get_state_dict` creates a missing optimizer state lazily by stepping
    once with zero gradients and lr = 0; that step still counts (`step` = 1), so a checkpoint or snapshot
    taken before the first real step would change the bias correction of that step (its update becomes
    0.74 lr instead of lr). Doing the same zero step here and rewinding `step` to 0 leaves zero moments at
    step 0, which is exactly a fresh AdamW, and makes later state-dict calls side-effect free.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].zero_() if isinstance(state["step"], torch.Tensor) else state.update(step=0)


def compile_now(module, device: torch.device) -> None:
    """Compile `module`'s decoder layers (`policy.compile_layers`) and build their graphs at once, during set-up
    rather than in the first steps: a forward and backward of a batch with padding, of one without and of packed
    ones (the attention mask takes three paths) of one bin and of two (torch specializes a dimension of size 1: a
    real packed micro-batch of several bins would compile again in the first step, 8 s of a W1 run's clock here),
    under the random state as it was (dropout draws nothing the run sees), the gradients dropped."""
    from asyncrl.algo.sampling import RAW
    from asyncrl.learner.batch import dummy_microbatch
    from asyncrl.learner.packing import PACK_WIDTH, packed_micro_batches
    from asyncrl.learner.policy import PolicyModel, compile_layers

    _require_cxx()
    compile_layers(module)
    ids = torch.zeros(4, 8, dtype=torch.long, device=device)
    positions = torch.arange(8, device=device).expand(4, 8)
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        one_bin = packed_micro_batches(dummy_microbatch(), 64, share=False)[0].layout
        # Two rows longer than half a bin: two bins of PACK_WIDTH slots.
        two_bins = packed_micro_batches(_dummy_rows(2, PACK_WIDTH // 2 + 1), 2 * PACK_WIDTH, share=False)[0].layout
        assert one_bin is not None and two_bins is not None  # a packed micro-batch has one
        assert one_bin.input_ids.shape[0] == 1 and two_bins.input_ids.shape[0] == 2
        packed_paths = [(padded, one_bin.to(device)), (padded, two_bins.to(device))]
        for mask, packed in [(padded, None), (torch.ones_like(ids), None), *packed_paths]:
            policy = isinstance(module, PolicyModel)
            out = module(ids, mask, positions, RAW, packed) if policy else module(ids, mask, positions, packed)
            torch.where(torch.isfinite(out), out, 0.0).sum().backward()
    module.zero_grad(set_to_none=True)


def _dummy_rows(rows: int, length: int):
    """`rows` rows of `length` tokens with zero loss mask and weights (`batch.dummy_microbatch`, wider)."""
    import dataclasses

    from asyncrl.learner.batch import dummy_microbatch

    one = dummy_microbatch()
    ints, floats = torch.zeros(rows, length, dtype=torch.long), torch.zeros(rows, length)
    return dataclasses.replace(
        one,
        input_ids=ints,
        attention_mask=torch.ones_like(ints),
        position_ids=torch.arange(length).expand(rows, length).clone(),
        loss_mask=torch.zeros(rows, length, dtype=torch.bool),
        rollout_logprobs=floats,
        advantages=floats,
        token_weights=floats,
        value_weights=floats,
        rewards=torch.zeros(rows),
        group_ids=torch.arange(rows),
        dones=torch.ones(rows, dtype=torch.bool),
        seq_lens=torch.full((rows,), length, dtype=torch.long),
    )


def _require_cxx() -> None:
    """torch's inductor builds the compiled kernels with a C++ compiler: name what is missing before it fails deep."""
    candidates = [c for c in (os.environ.get("CXX"), "g++", "clang++", "c++") if c]
    if not any(shutil.which(c) for c in candidates):
        raise RuntimeError(
            "learner.compile needs a C++ compiler where the learner runs "
            f"(torch.compile builds its kernels with one): none of {', '.join(candidates)} is on PATH here; "
            "install one (apt-get install g++) or set learner.compile=false"
        )
