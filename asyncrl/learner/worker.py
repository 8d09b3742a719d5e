"""`LearnerWorker` (one Ray actor per rank) and `LearnerPool` (the driver-side handle on all ranks).

The ranks form ONE torch.distributed group (gloo on CPU, nccl on GPU) and shard the policy (and the
optional critic) with FSDP2. One optimizer step per batch:

    pool: groups -> build_batch (outcome advantages + reduction weights over the WHOLE batch)
          -> split_rows (token-balanced; whole groups for gvpo) -> each rank's train_step
    rank: micro_batches by token budget, padded to the same count on every rank (FSDP collectives)
          [critic: values -> GAE/VAPO advantages per sequence, whitening with global statistics]
          per micro-batch: learner log-probs (FP32 head, / temperature) -> compute_policy_loss -> backward
          clip_grad_norm_ -> AdamW step -> scheduler step  [critic: value loss, its own step]

`old_logprobs` are the detached learner log-probs of this very forward: the batch gets exactly one
optimizer step, so the PPO ratio rho = pi_theta / pi_old is 1 in value (its gradient is what PPO/CISPO
need) and the mismatch `kappa = pi_old / mu` is measured against the rollout log-probs. Only when the
reduction denominators depend on a rejection mask (`recipe.denominator_after_rejection`) is there a
separate no-grad pass first, because the weights of every rank must be known before any backward.

Gradients are summed across ranks (policy.py), so the loss is never rescaled by dp_size.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from asyncrl.learner.batch import (
    CRITIC_ADVANTAGES,
    TrainBatch,
    build_batch,
    dummy_microbatch,
    loss_needs_whole_groups,
    micro_batches,
    split_rows,
)
from asyncrl.types import Group, StepStats

__all__ = ["LearnerPool", "LearnerWorker", "apply_whitening", "materialize_optimizer_state", "merge_metrics", "recipe_from_config", "whitening_moments"]

# Metrics that are partial sums of the batch loss (added up over micro-batches and ranks); `*_max` and
# `*_min` take the extreme; everything else is a loss-token-weighted mean.
_SUMMED = ("pg_loss", "kl_loss", "value_loss")


def merge_metrics(parts: Sequence[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Combine (metrics, weight) pairs of micro-batches or ranks; weight = valid loss tokens."""
    keys = {k for metrics, _ in parts for k in metrics}
    out: dict[str, float] = {}
    for key in sorted(keys):
        pairs = [(m[key], w) for m, w in parts if key in m]
        values = [v for v, _ in pairs]
        if key in _SUMMED or key.endswith("_sum"):
            out[key] = float(sum(values))
        elif key.endswith("_max"):
            out[key] = float(max(values))
        elif key.endswith("_min"):
            out[key] = float(min(values))
        else:
            total = sum(w for _, w in pairs)
            out[key] = float(sum(v * w for v, w in pairs) / total) if total > 0 else float(np.mean(values))
    return out


def _linear_warmup(warmup_steps: int):
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


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
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].zero_() if isinstance(state["step"], torch.Tensor) else state.update(step=0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def recipe_from_config(cfg):
    """The run's `Recipe`: `algorithm` preset, overrides and params; Dr. GRPO's fixed L_max defaults to
    `rollout.max_tokens` (the longest response the engines may produce)."""
    from asyncrl.algo.recipes import resolve_recipe

    algo = cfg.algorithm
    params = dict(algo.params)
    if algo.resolved_names()["reduction"] == "seq_mean_token_sum_norm":
        params.setdefault("l_max", cfg.rollout.max_tokens)
    return resolve_recipe(algo.preset, algo.advantage, algo.loss, algo.reduction, algo.correction, **params)


def whitening_moments(advantages: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """(count, sum, sum of squares) of the valid entries, float64 [3]; sum them over ranks."""
    moments = torch.zeros(3, dtype=torch.float64)
    for adv, mask in zip(advantages, masks):
        x = adv[mask.bool()].double().cpu()
        moments += torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * x).sum()])
    return moments


def apply_whitening(
    advantages: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], moments: torch.Tensor, eps: float = 1e-8
) -> list[torch.Tensor]:
    """`algo.advantages.masked_whiten` with batch-global moments: (x - mean) / sqrt(var_unbiased + eps),
    0 at masked positions (and everywhere when fewer than 2 entries are valid)."""
    count, total, total_sq = moments.tolist()
    mean = total / max(count, 1.0)
    var = max(total_sq - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    scale = (var + eps) ** -0.5 if count >= 2 else 0.0
    return [torch.where(m.bool(), (a - mean) * scale, torch.zeros_like(a)).float() for a, m in zip(advantages, masks)]


class LearnerWorker:
    """One learner rank. Construct through `LearnerPool` (it is wrapped with `ray.remote` there); every
    public method except `master_address` is collective: all ranks must call it together."""

    def __init__(self, rank: int, num_ranks: int, model_dir: str, config, recipe, temperature: float, dtype: str = "float32"):
        self.rank = rank
        self.num_ranks = num_ranks
        self.model_dir = str(model_dir)
        self.config = config  # asyncrl.config.LearnerConfig
        self.recipe = recipe  # asyncrl.algo.recipes.Recipe
        self.temperature = temperature
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.step = 0

    # ------------------------------------------------------------------ setup

    def master_address(self) -> tuple[str, int]:
        """Rank 0 picks the rendezvous address (its node IP and a free port)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from asyncrl.learner.checkpoint import TrainState
        from asyncrl.learner.policy import PolicyModel, ValueModel, load_causal_lm, shard

        cfg = self.config
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, int(cfg.num_cpus_per_rank)))
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.num_ranks,
            timeout=timedelta(seconds=timeout_s),
        )
        mesh = init_device_mesh(self.device.type, (self.num_ranks,))
        torch.manual_seed(cfg.seed)

        causal_lm = load_causal_lm(self.model_dir, self.dtype)
        self.model_config = causal_lm.config
        policy = PolicyModel(causal_lm).to(self.device)
        shard(policy, mesh)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        materialize_optimizer_state(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _linear_warmup(cfg.warmup_steps))
        self.state = TrainState(policy, optimizer, scheduler)
        if cfg.critic:
            critic = ValueModel(load_causal_lm(self.model_dir, self.dtype), seed=cfg.seed).to(self.device)
            shard(critic, mesh)
            critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, betas=cfg.betas)
            materialize_optimizer_state(critic_optimizer)
            self.state.critic = critic
            self.state.critic_optimizer = critic_optimizer
            self.state.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, _linear_warmup(cfg.warmup_steps))

    # ------------------------------------------------------------------ forward helpers

    def _logprobs(self, mb: TrainBatch) -> torch.Tensor:
        return self.state.policy(mb.input_ids, mb.attention_mask, mb.position_ids, self.temperature)

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        return self.state.critic(mb.input_ids, mb.attention_mask, mb.position_ids)

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        moved = {
            f.name: (v.to(self.device) if isinstance(v := getattr(mb, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(mb)
        }
        return TrainBatch(**moved)

    def _all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=reduce_op)
        return tensor

    def _micro_batches(self, rows: TrainBatch) -> tuple[list[TrainBatch], int]:
        """This rank's micro-batches padded with dummies to the largest count over ranks; -> (all, real)."""
        mbs = micro_batches(rows, self.config.tokens_per_microbatch, loss_needs_whole_groups(self.recipe)) if rows.num_rows else []
        count = int(self._all_reduce(torch.tensor([len(mbs)]), "max").item())
        real = len(mbs)
        mbs += [dummy_microbatch(rows.num_groups) for _ in range(count - real)]
        return [self._to_device(mb) for mb in mbs], real

    # ------------------------------------------------------------------ advantages and weights on the rank

    def _critic_advantages(self, mbs: list[TrainBatch]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """GAE / VAPO per sequence from the critic's current values; whitening uses batch-global moments."""
        from asyncrl.algo.recipes import compute_advantages

        recipe = dataclasses.replace(self.recipe, whiten_advantages=False)
        advantages, returns = [], []
        with torch.no_grad():
            for mb in mbs:
                values = self._values(mb)
                rows = torch.arange(mb.num_rows, device=values.device)
                # V(s_T) of the state after the last token; GAE uses it only where the row was truncated.
                bootstrap = values[rows, mb.seq_lens - 1]
                adv, ret = compute_advantages(recipe, mb.rewards, mb.group_ids, mb.loss_mask, values, mb.dones, bootstrap)
                advantages.append(adv.float())
                returns.append(ret.float())
        if self.recipe.whiten_advantages:
            advantages = self._global_whiten(advantages, [mb.loss_mask for mb in mbs])
        return advantages, returns

    def _global_whiten(self, advantages: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        moments = self._all_reduce(whitening_moments(advantages, masks).to(self.device))
        return apply_whitening(advantages, masks, moments)

    def _weights_after_rejection(self, mbs: list[TrainBatch], real: int, old: list[torch.Tensor]) -> list[torch.Tensor]:
        """Reduction weights whose denominators count tokens kept by the correction (verl convention),
        with the statistics summed over every micro-batch of every rank before any backward."""
        from asyncrl.algo.recipes import denominator_mask
        from asyncrl.algo.reduction import reduction_stats, reduction_weights

        masks = [denominator_mask(self.recipe, mb.loss_mask, o, mb.rollout_logprobs) for mb, o in zip(mbs, old)]
        num_groups = mbs[0].num_groups if mbs else 1
        stats = torch.zeros(3 + num_groups, dtype=torch.int64, device=self.device)
        for mb, mask in zip(mbs[:real], masks[:real]):  # dummies must not count as sequences
            stats += reduction_stats(mask, mb.group_ids, num_groups)
        stats = self._all_reduce(stats)
        return [
            reduction_weights(self.recipe.reduction, m, mb.group_ids, self.recipe.l_max, stats) if i < real else mb.token_weights
            for i, (mb, m) in enumerate(zip(mbs, masks))
        ]

    # ------------------------------------------------------------------ the step

    def _accumulate(self, rows: TrainBatch, policy: bool = True) -> dict[str, Any]:
        """Backward of the policy loss of this rank's rows (gradients accumulate, no step). With
        `policy=False` only the critic's advantages and returns are computed."""
        from asyncrl.algo.metrics import mismatch_metrics
        from asyncrl.algo.recipes import compute_policy_loss

        recipe = self.recipe
        mbs, real = self._micro_batches(rows)
        advantages, returns = [mb.advantages for mb in mbs], [None] * len(mbs)
        if recipe.advantage in CRITIC_ADVANTAGES:
            if self.state.critic is None:
                raise ValueError(f"advantage {recipe.advantage!r} needs a critic: set learner.critic = true")
            advantages, returns = self._critic_advantages(mbs)
        if not policy:
            return {"loss": 0.0, "metrics": {}, "mbs": mbs, "real": real, "returns": returns}
        old: list[torch.Tensor | None] = [None] * len(mbs)
        weights = [mb.token_weights for mb in mbs]
        if recipe.denominator_after_rejection:
            with torch.no_grad():
                old = [self._logprobs(mb) for mb in mbs]
            weights = self._weights_after_rejection(mbs, real, old)

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts, old_seen = [], []
        for i, mb in enumerate(mbs):
            learner_logprobs = self._logprobs(mb)
            old_logprobs = old[i] if old[i] is not None else learner_logprobs.detach()
            loss, metrics = compute_policy_loss(
                recipe, learner_logprobs, old_logprobs, mb.rollout_logprobs, advantages[i], mb.loss_mask, weights[i], mb.group_ids
            )
            loss.backward()
            loss_sum += loss.detach().double()
            if i < real:
                parts.append((metrics, float(mb.num_loss_tokens)))
                old_seen.append((old_logprobs, mb.rollout_logprobs, mb.loss_mask.long()))
        metrics = merge_metrics(parts)
        if old_seen and any(int(m.sum()) for _, _, m in old_seen):
            olds, rollouts, masks = (_pad_cat([x[j] for x in old_seen]) for j in range(3))
            cap = recipe.tis_cap
            metrics.update({f"mismatch_{k}": v for k, v in mismatch_metrics(olds, rollouts, masks.bool(), cap).items()})
        loss_total = float(self._all_reduce(loss_sum).item())
        return {"loss": loss_total, "metrics": metrics, "mbs": mbs, "real": real, "returns": returns}

    def _clip_and_step(self, module, optimizer, scheduler) -> tuple[float, bool]:
        """Clip to `grad_clip`, step unless the norm is not finite; -> (pre-clip norm, stepped)."""
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), self.config.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        stepped = bool(np.isfinite(norm))
        if stepped:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def _critic_step(self, mbs: list[TrainBatch], real: int, returns: list[torch.Tensor]) -> dict[str, float]:
        from asyncrl.algo.recipes import compute_value_loss

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = []
        for i, mb in enumerate(mbs):
            loss, metrics = compute_value_loss(self._values(mb), returns[i], mb.loss_mask, mb.value_weights)
            loss.backward()
            loss_sum += loss.detach().double()
            if i < real:
                parts.append((metrics, float(mb.num_loss_tokens)))
        norm, stepped = self._clip_and_step(self.state.critic, self.state.critic_optimizer, self.state.critic_scheduler)
        metrics = {f"critic_{k}": v for k, v in merge_metrics(parts).items() if k != "value_loss"}
        metrics.update(
            critic_value_loss=float(self._all_reduce(loss_sum).item()), critic_grad_norm=norm, critic_skipped_step=float(not stepped)
        )
        return metrics

    def train_step(self, rows: TrainBatch) -> StepStats:
        """One optimizer step on this rank's rows. `loss` and `grad_norm` are global (whole batch);
        samples, tokens and metrics are this rank's (the pool merges them)."""
        # VAPO-style value pre-training: a random value head gives random GAE advantages (with short
        # answers the length-adaptive lambda is clamped to 0, so advantages are pure TD errors), which
        # drive the policy down. The policy waits until the critic has seen `critic_warmup_steps` batches.
        frozen = self.state.critic is not None and self.step < self.config.critic_warmup_steps
        acc = self._accumulate(rows, policy=not frozen)
        lr = self.state.optimizer.param_groups[0]["lr"]
        if frozen:
            grad_norm, stepped = 0.0, False
        else:
            grad_norm, stepped = self._clip_and_step(self.state.policy, self.state.optimizer, self.state.scheduler)
        metrics = dict(acc["metrics"], lr=lr, skipped_step=float(not stepped and not frozen), policy_frozen=float(frozen))
        if self.state.critic is not None and acc["returns"][0] is not None:
            metrics.update(self._critic_step(acc["mbs"], acc["real"], acc["returns"]))
        self.step += 1
        return StepStats(
            step=self.step,
            version=0,
            loss=acc["loss"],
            grad_norm=grad_norm,
            num_samples=rows.num_rows,
            num_tokens=rows.num_tokens,
            metrics=dict(metrics, loss_tokens=float(rows.num_loss_tokens)),
        )

    def compute_gradients(self, rows: TrainBatch, recipe=None) -> tuple[float, dict[str, np.ndarray] | None]:
        """The full (unsharded) policy gradient of the batch loss, without stepping; -> (loss, grads on
        rank 0 / None elsewhere), by Hugging Face name. `recipe` overrides the pool's for this call."""
        from asyncrl.learner.policy import hf_name

        pool_recipe, self.recipe = self.recipe, (recipe or self.recipe)
        try:
            acc = self._accumulate(rows)
        finally:
            self.recipe = pool_recipe
        grads = {}
        for name, param in self.state.policy.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[hf_name(name)] = grad.detach().float().cpu().numpy()
        self.state.optimizer.zero_grad(set_to_none=True)
        return acc["loss"], (grads if self.rank == 0 else None)

    def score(self, token_ids: Sequence[int], prompt_len: int, temperature: float | None = None) -> np.ndarray:
        """Learner log-probs of `token_ids[prompt_len:]` given their prefixes (the parity probe)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        n = ids.shape[1]
        if not 1 <= prompt_len < n:
            raise ValueError(f"score: need 1 <= prompt_len < len(token_ids) (got {prompt_len}, {n})")
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        with torch.no_grad():
            logprobs = self.state.policy(ids, torch.ones_like(ids), positions, temperature or self.temperature)
        return logprobs[0, prompt_len - 1 : n - 1].cpu().numpy()

    # ------------------------------------------------------------------ weights, snapshots, checkpoints

    def _full_model_state(self, module) -> dict[str, torch.Tensor]:
        """Full state dict gathered by all ranks; populated on rank 0, empty elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _hf_state(self) -> dict[str, torch.Tensor]:
        from asyncrl.learner.publish import hf_state_dict

        full = self._full_model_state(self.state.policy)
        return hf_state_dict(full, bool(getattr(self.model_config, "tie_word_embeddings", False))) if self.rank == 0 else {}

    def export_weights(self, bucket_bytes: int):
        """Rank 0 packs the HF-named weights into safetensors buckets and puts them in the object store."""
        import ray

        from asyncrl.learner.publish import ExportedWeights, pack_state_dict

        state = self._hf_state()
        if self.rank != 0:
            return None
        buckets, num_bytes, num_tensors = pack_state_dict(state, bucket_bytes, self.dtype)
        return ExportedWeights(refs=[ray.put(b) for b in buckets], num_bytes=num_bytes, num_tensors=num_tensors)

    def state_snapshot(self) -> dict[str, Any] | None:
        """Full parameters (HF names) and optimizer state as numpy on rank 0, for tests and debugging."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        params = self._hf_state()
        optim = get_optimizer_state_dict(
            self.state.policy, self.state.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank != 0:
            return None
        moments = {
            f"{hf_name_}/{key}": torch.as_tensor(value).float().numpy()
            for name, entry in optim["state"].items()
            for key, value in entry.items()
            for hf_name_ in [name.removeprefix("causal_lm.")]
        }
        return {
            "params": {k: v.float().numpy() for k, v in params.items()},
            "optimizer": moments,
            "lr": self.state.optimizer.param_groups[0]["lr"],
            "step": self.step,
        }

    def save_checkpoint(self, folder: str) -> None:
        from asyncrl.learner.checkpoint import save_train_state

        save_train_state(folder, self.state, self.rank, self.step)

    def load_checkpoint(self, folder: str) -> int:
        from asyncrl.learner.checkpoint import load_train_state

        self.step = load_train_state(folder, self.state, self.rank)
        return self.step

    def export_hf(self, folder: str) -> None:
        """A Hugging Face folder (config, tokenizer, safetensors) that transformers and vLLM load."""
        from transformers import AutoModelForCausalLM

        from asyncrl.learner.checkpoint import copy_tokenizer_files

        state = self._hf_state()
        if self.rank != 0:
            return
        copy_tokenizer_files(self.model_dir, folder)
        model = AutoModelForCausalLM.from_config(self.model_config, dtype=self.dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"export_hf: state dict does not match the model (missing {missing}, unexpected {unexpected})")
        model.save_pretrained(folder, safe_serialization=True)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerPool:
    """Driver-side handle on `num_ranks` LearnerWorker actors forming one torch.distributed group.

    Holds the step counter and the policy version (the version of the last published weights), which the
    controller advances through a `WeightPublisher`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config,
        recipe,
        temperature: float = 1.0,
        dtype: str = "float32",
        init_timeout_s: float = 300.0,
    ):
        import ray

        self.config = config
        self.recipe = recipe
        self.num_ranks = config.num_ranks
        self.step = 0
        self.version = 0
        self.last_export = None
        actor = ray.remote(LearnerWorker).options(num_cpus=config.num_cpus_per_rank, num_gpus=config.num_gpus_per_rank)
        self.workers = [
            actor.remote(rank, self.num_ranks, str(model_dir), config, recipe, temperature, dtype) for rank in range(self.num_ranks)
        ]
        addr, port = ray.get(self.workers[0].master_address.remote(), timeout=init_timeout_s)
        self._call("setup", addr, port, init_timeout_s, timeout_s=init_timeout_s + 60)

    @classmethod
    def from_config(cls, cfg, model_dir: str | os.PathLike) -> LearnerPool:
        """Build from the run's `asyncrl.config.Config` (recipe from `algorithm`, temperature from `rollout`)."""
        return cls(model_dir, cfg.learner, recipe_from_config(cfg), cfg.rollout.temperature, cfg.model.dtype)

    def _call(self, method: str, *args, timeout_s: float | None = None, per_rank: Sequence[tuple] | None = None) -> list:
        """Call `method` on every rank at once (collective) and wait; a failure names the rank."""
        import ray

        refs = [
            getattr(w, method).remote(*(per_rank[r] if per_rank is not None else args)) for r, w in enumerate(self.workers)
        ]
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=timeout_s))
            except Exception as e:
                raise RuntimeError(f"learner rank {rank}: {method} failed: {e}") from e
        return results

    # ------------------------------------------------------------------ training

    def make_batch(self, groups: Sequence[Group], recipe=None) -> TrainBatch:
        return build_batch(groups, recipe or self.recipe)

    def train_step(self, groups: Sequence[Group]) -> StepStats:
        """One optimizer step on `groups` (the readiness units the buffer handed out)."""
        return self.train_batch(self.make_batch(groups))

    def train_batch(self, batch: TrainBatch) -> StepStats:
        began = time.perf_counter()
        shards = split_rows(batch, self.num_ranks, loss_needs_whole_groups(self.recipe))
        results: list[StepStats] = self._call("train_step", per_rank=[(s,) for s in shards])
        self.step = results[0].step
        metrics = merge_metrics([(r.metrics, r.metrics.get("loss_tokens", 0.0)) for r in results])
        metrics.pop("loss_tokens", None)
        metrics["learner_step_s"] = time.perf_counter() - began
        lag = (self.version - batch.min_version).float()
        metrics.update(staleness_mean_versions=float(lag.mean()), staleness_max_versions=float(lag.max()))
        return StepStats(
            step=self.step,
            version=self.version,
            loss=results[0].loss,
            grad_norm=results[0].grad_norm,
            num_samples=sum(r.num_samples for r in results),
            num_tokens=sum(r.num_tokens for r in results),
            metrics=metrics,
        )

    def compute_gradients(self, batch: TrainBatch, recipe=None) -> tuple[float, dict[str, np.ndarray]]:
        """(batch loss, full policy gradient by HF name) without an optimizer step (tests, debugging).
        `recipe` (default: the pool's) must be the one `batch` was built with."""
        recipe = recipe or self.recipe
        shards = split_rows(batch, self.num_ranks, loss_needs_whole_groups(recipe))
        loss, grads = self._call("compute_gradients", per_rank=[(s, recipe) for s in shards])[0]
        return loss, grads

    def score(self, token_ids: Sequence[int], prompt_len: int, temperature: float | None = None) -> np.ndarray:
        return self._call("score", list(token_ids), prompt_len, temperature)[0]

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights_info(self, bucket_bytes: int):
        """Gather + pack + ray.put the policy weights; -> publish.ExportedWeights (refs owned by rank 0)."""
        self.last_export = self._call("export_weights", bucket_bytes)[0]
        return self.last_export

    def export_weights(self, bucket_bytes: int) -> list:
        """Refs to safetensors buckets of the current policy (HF names, tied lm_head explicit)."""
        return self.export_weights_info(bucket_bytes).refs

    def state_snapshot(self) -> dict[str, Any]:
        return self._call("state_snapshot")[0]

    def save_checkpoint(self, folder: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, schedulers, RNG (+ critic) of every rank, then `extra` (JSON) and the
        step/version marker that makes the checkpoint complete."""
        from asyncrl.learner.checkpoint import write_learner_state

        self._call("save_checkpoint", str(folder))
        write_learner_state(folder, step=self.step, version=self.version, num_ranks=self.num_ranks, extra=extra or {})

    def load_checkpoint(self, folder: str | os.PathLike) -> dict[str, Any]:
        """Restore a complete checkpoint into this pool; -> the controller's `extra` dict."""
        from asyncrl.learner.checkpoint import read_learner_state

        state, extra = read_learner_state(folder)
        self._call("load_checkpoint", str(folder))
        self.step, self.version = int(state["step"]), int(state["version"])
        return extra

    def export_hf(self, folder: str | os.PathLike) -> None:
        self._call("export_hf", str(folder))

    def shutdown(self) -> None:
        import ray

        try:
            self._call("shutdown", timeout_s=30)
        finally:
            for w in self.workers:
                ray.kill(w)
