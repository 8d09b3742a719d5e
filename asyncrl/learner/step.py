"""The optimizer step of one learner rank, and the math that merges it across micro-batches and ranks.

    rank: micro_batches by token budget, padded to the same count on every rank (FSDP collectives)
          [critic: values -> GAE/VAPO advantages per sequence, whitening with global statistics]
          per micro-batch: learner log-probs (FP32 head, / temperature) -> compute_policy_loss -> backward
          clip_grad_norm_ -> AdamW step -> scheduler step  [critic: value loss, its own step]

`old_logprobs` are the detached learner log-probs of this very forward: the batch gets exactly one
optimizer step, so the PPO ratio rho = pi_theta / pi_old is 1 in value (its gradient is what PPO/CISPO
need) and the mismatch `kappa = pi_old / mu` is measured against the rollout log-probs. Only when the
reduction denominators depend on a rejection mask (`recipe.denominator_after_rejection`), or batch-normalised
TIS needs the mean TIS weight of the whole batch (`recipe.normalizes_tis`), is there a separate no-grad pass
first: those statistics, summed over every micro-batch of every rank, must be known before any backward.

Gradients are summed across ranks (policy.py), so the loss is never rescaled by dp_size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.learner.batch import CRITIC_ADVANTAGES, TrainBatch, dummy_microbatch, loss_needs_whole_groups, micro_batches
from asyncrl.types import StepStats

if TYPE_CHECKING:
    from asyncrl.algo.recipes import Recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.checkpoint import TrainState

__all__ = ["Accumulated", "AllReduce", "RankStep", "apply_whitening", "merge_metrics", "whitening_moments"]

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""`(tensor, "sum" | "max") -> tensor` reduced over every rank, on the rank's device (a collective)."""

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


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


@dataclass
class Accumulated:
    """One rank's backward pass over its rows: gradients are in the modules, not stepped yet.

    Invariant: `micro_batches[:real]` are this rank's rows, the rest are dummies (every rank runs the same
    number of micro-batches); `returns` has one entry per micro-batch, or is None without a critic estimator.
    """

    loss: float
    """The policy loss of the whole batch (summed over ranks); 0 when only the critic's advantages ran."""
    metrics: dict[str, float]
    """This rank's loss-token-weighted policy metrics (`merge_metrics` combines the ranks)."""
    micro_batches: list[TrainBatch]
    real: int
    returns: list[torch.Tensor] | None
    """Value targets of the critic estimator per micro-batch."""


@dataclass(frozen=True)
class RankStep:
    """The step of one rank over its share of a batch; every method is collective (all ranks together)."""

    state: TrainState
    config: LearnerConfig
    recipe: Recipe
    temperature: float
    device: torch.device
    all_reduce: AllReduce

    # ------------------------------------------------------------------ the step

    def train(self, rows: TrainBatch, step: int) -> StepStats:
        """Optimizer step number `step + 1` on this rank's rows. `loss` and `grad_norm` are global (whole
        batch); samples, tokens and metrics are this rank's (the pool merges them)."""
        # VAPO-style value pre-training: a random value head gives random GAE advantages (with short
        # answers the length-adaptive lambda is clamped to 0, so advantages are pure TD errors), which
        # drive the policy down. The policy waits until the critic has seen `critic_warmup_steps` batches.
        frozen = self.state.critic is not None and step < self.config.critic_warmup_steps
        acc = self.accumulate(rows, policy=not frozen)
        lr = self.state.optimizer.param_groups[0]["lr"]
        if frozen:
            grad_norm, stepped = 0.0, False
        else:
            grad_norm, stepped = self._clip_and_step(self.state.policy, self.state.optimizer, self.state.scheduler)
        metrics = dict(acc.metrics, lr=lr, skipped_step=float(not stepped and not frozen), policy_frozen=float(frozen))
        if self.state.critic is not None and acc.returns is not None:
            metrics.update(self._critic_step(acc))
        return StepStats(
            step=step + 1,
            loss=acc.loss,
            grad_norm=grad_norm,
            num_samples=rows.num_rows,
            num_tokens=rows.num_tokens,
            metrics=dict(metrics, loss_tokens=float(rows.num_loss_tokens)),
        )

    def gradients(self, rows: TrainBatch) -> tuple[float, dict[str, np.ndarray]]:
        """(batch loss, full unsharded policy gradient by Hugging Face name) without stepping."""
        from asyncrl.learner.policy import hf_name

        acc = self.accumulate(rows)
        grads = {}
        for name, param in self.state.policy.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[hf_name(name)] = grad.detach().float().cpu().numpy()
        self.state.optimizer.zero_grad(set_to_none=True)
        return acc.loss, grads

    def accumulate(self, rows: TrainBatch, policy: bool = True) -> Accumulated:
        """Backward of the policy loss of this rank's rows (gradients accumulate, no step). With
        `policy=False` only the critic's advantages and returns are computed."""
        recipe = self.recipe
        mbs, real = self._micro_batches(rows)
        advantages, returns = [mb.advantages for mb in mbs], None
        if recipe.advantage in CRITIC_ADVANTAGES:
            if self.state.critic is None:
                raise ValueError(f"advantage {recipe.advantage!r} needs a critic: set learner.critic = true")
            advantages, returns = self._critic_advantages(mbs)
        if not policy:
            return Accumulated(0.0, {}, mbs, real, returns)
        old: list[torch.Tensor | None] = [None] * len(mbs)
        weights, tis_stats = [mb.token_weights for mb in mbs], None
        if recipe.denominator_after_rejection or recipe.normalizes_tis:
            with torch.no_grad():
                old = [self._logprobs(mb) for mb in mbs]
        if recipe.denominator_after_rejection:
            weights = self._weights_after_rejection(mbs, real, old)
        if recipe.normalizes_tis:
            tis_stats = self._tis_stats(mbs[:real], old[:real])
        loss, metrics = self._policy_backward(mbs, real, advantages, old, weights, tis_stats)
        return Accumulated(loss, metrics, mbs, real, returns)

    def _tis_stats(self, mbs: list[TrainBatch], old: list[torch.Tensor]) -> torch.Tensor:
        """(sum of truncated TIS weights, valid tokens) over the whole optimizer batch: every micro-batch of
        every rank, so batch-normalised TIS divides by the same mean whatever the split."""
        from asyncrl.algo.recipes import tis_normalizer_stats

        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for mb, o in zip(mbs, old):
            stats += tis_normalizer_stats(self.recipe, mb.loss_mask, o, mb.rollout_logprobs).to(self.device)
        return self.all_reduce(stats, "sum")

    def _policy_backward(
        self,
        mbs: list[TrainBatch],
        real: int,
        advantages: list[torch.Tensor],
        old: list[torch.Tensor | None],
        weights: list[torch.Tensor],
        tis_stats: torch.Tensor | None,
    ) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch; -> (global batch loss, this rank's metrics)."""
        from asyncrl.algo.recipes import compute_policy_loss

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts, old_seen = [], []
        for i, mb in enumerate(mbs):
            learner_logprobs = self._logprobs(mb)
            old_logprobs = old[i] if old[i] is not None else learner_logprobs.detach()
            loss, metrics = compute_policy_loss(
                self.recipe, learner_logprobs, old_logprobs, mb.rollout_logprobs, advantages[i], mb.loss_mask, weights[i], mb.group_ids,
                tis_stats=tis_stats,
            )
            loss.backward()
            loss_sum += loss.detach().double()
            if i < real:
                parts.append((metrics, float(mb.num_loss_tokens)))
                old_seen.append((old_logprobs, mb.rollout_logprobs, mb.loss_mask.long()))
        metrics = merge_metrics(parts)
        metrics.update(self._mismatch(old_seen))
        return float(self.all_reduce(loss_sum, "sum").item()), metrics

    def _mismatch(self, seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """`mismatch_*` metrics of (old, rollout log-probs, loss mask) over this rank's real micro-batches."""
        from asyncrl.algo.metrics import mismatch_metrics

        if not seen or not any(int(m.sum()) for _, _, m in seen):
            return {}
        olds, rollouts, masks = (_pad_cat([x[j] for x in seen]) for j in range(3))
        return {f"mismatch_{k}": v for k, v in mismatch_metrics(olds, rollouts, masks.bool(), self.recipe.tis_cap).items()}

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

    def _critic_step(self, acc: Accumulated) -> dict[str, float]:
        from asyncrl.algo.recipes import compute_value_loss

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = []
        for i, mb in enumerate(acc.micro_batches):
            loss, metrics = compute_value_loss(self._values(mb), acc.returns[i], mb.loss_mask, mb.value_weights)
            loss.backward()
            loss_sum += loss.detach().double()
            if i < acc.real:
                parts.append((metrics, float(mb.num_loss_tokens)))
        norm, stepped = self._clip_and_step(self.state.critic, self.state.critic_optimizer, self.state.critic_scheduler)
        metrics = {f"critic_{k}": v for k, v in merge_metrics(parts).items() if k != "value_loss"}
        metrics.update(
            critic_value_loss=float(self.all_reduce(loss_sum, "sum").item()), critic_grad_norm=norm, critic_skipped_step=float(not stepped)
        )
        return metrics

    # ------------------------------------------------------------------ forward helpers and micro-batches

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

    def _micro_batches(self, rows: TrainBatch) -> tuple[list[TrainBatch], int]:
        """This rank's micro-batches padded with dummies to the largest count over ranks; -> (all, real)."""
        mbs = micro_batches(rows, self.config.tokens_per_microbatch, loss_needs_whole_groups(self.recipe)) if rows.num_rows else []
        count = int(self.all_reduce(torch.tensor([len(mbs)]), "max").item())
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
            masks = [mb.loss_mask for mb in mbs]
            moments = self.all_reduce(whitening_moments(advantages, masks).to(self.device), "sum")
            advantages = apply_whitening(advantages, masks, moments)
        return advantages, returns

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
        stats = self.all_reduce(stats, "sum")
        return [
            reduction_weights(self.recipe.reduction, m, mb.group_ids, self.recipe.l_max, stats) if i < real else mb.token_weights
            for i, (mb, m) in enumerate(zip(mbs, masks))
        ]
