"""The optimizer steps of one learner rank (the math that merges them across micro-batches, ranks and updates:
`merge.py`).

    rank: micro_batches by token budget (packed bins, a group's shared prompt once: `packing.py`), padded to the
          same count on every rank (FSDP collectives)
          [critic: values -> GAE/VAPO advantages per sequence, whitening with global statistics]
          per micro-batch: learner log-probs (FP32 head, processed like the engine's sampling: temperature,
                           top-k, top-p) [kl_coef > 0: the frozen reference's, the same way, no grad]
                           -> compute_policy_loss -> backward
          clip_grad_norm_ -> AdamW step -> scheduler step  [critic: value loss, its own step]

One update per rollout batch (`learner.mini_batches` = `epochs` = 1): `old_logprobs` are the detached
learner log-probs of this very forward, so the PPO ratio rho = pi_theta / pi_old is 1 in value (its
gradient is what PPO/CISPO need) and the mismatch `kappa = pi_old / mu` is measured against the rollout
log-probs. Only when the reduction denominators depend on a rejection mask
(`recipe.denominator_after_rejection`), or batch-normalised TIS needs the mean TIS weight of the whole
batch (`recipe.normalizes_tis`), is there a separate no-grad pass first: those statistics, summed over
every micro-batch of every rank, must be known before any backward.

Several updates (`RankStep.train` with more than one mini-batch, or `epochs` > 1): critic advantages and
pi_old come from one no-grad pass over every mini-batch BEFORE the first optimizer step and are kept for
every update, so rho and the clip act from the second update on and DIS gates the current policy. Each
update is the single-update step above on one mini-batch with that fixed pi_old; the learning-rate
schedules advance once per rollout batch. `learner.kl_stop` ends the step early, decided on the
all-reduced approx-KL so every rank stops at the same update.

Under top-k / top-p a token may lie outside the learner's kept set (log-prob -inf, `algo.sampling`): it
is taken out of the loss like a rejected token and counted in `outside_support_frac`.

Gradients are summed across ranks (policy.py), so the loss is never rescaled by dp_size.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncrl.algo.sampling import SamplingDistribution, in_support
from asyncrl.learner.batch import (
    CRITIC_ADVANTAGES,
    TrainBatch,
    dummy_microbatch,
    loss_needs_whole_groups,
    micro_batches,
)
from asyncrl.learner.merge import (
    Update,
    apply_whitening,
    mean_over_updates,
    merge_metrics,
    pad_cat,
    regroup,
    update_metrics,
    whitening_moments,
)
from asyncrl.learner.packing import PackedLayout, packable, packed_micro_batches
from asyncrl.types import StepStats

if TYPE_CHECKING:
    from asyncrl.algo.recipes import Recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.checkpoint import TrainState

__all__ = ["Accumulated", "AllReduce", "MiniBatch", "RankStep"]

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""`(tensor, "sum" | "max") -> tensor` reduced over every rank, on the rank's device (a collective)."""


@dataclass
class MiniBatch:
    """One optimizer batch on this rank, ready for any number of updates.

    Invariant: `micro_batches[:real]` are this rank's rows, the rest are dummies (every rank runs the same
    number of micro-batches). Per micro-batch: `advantages`; `returns` (critic value targets, or None
    without a critic estimator); `old`, pi_old from before the step's first update (None: the detached
    log-probs of the update's own forward, the single-update step); `weights`, the reduction weights
    (recomputed from `old` when the denominators count tokens kept after rejection). `tis_stats` is the
    batch-normalised TIS normaliser from `old`; `ref`, the frozen reference's log-probs (KL loss term; None: taken
    in the update's own pass). All of them stay fixed for every update of the step.
    """

    micro_batches: list[TrainBatch]
    real: int
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None
    old: Sequence[torch.Tensor | None]
    weights: list[torch.Tensor]
    tis_stats: torch.Tensor | None
    ref: Sequence[torch.Tensor | None] = ()

    @property
    def loss_tokens(self) -> int:
        return sum(mb.num_loss_tokens for mb in self.micro_batches[: self.real])


@dataclass
class Accumulated:
    """One rank's backward pass over its rows: gradients are in the modules, not stepped yet."""

    loss: float
    """The policy loss of the whole batch (summed over ranks); 0 when only the critic's advantages ran."""
    metrics: dict[str, float]
    """This rank's loss-token-weighted policy metrics (`merge_metrics` combines the ranks)."""
    batch: MiniBatch


@dataclass(frozen=True)
class RankStep:
    """The step of one rank over its share of a batch; every method is collective (all ranks together)."""

    state: TrainState
    config: LearnerConfig
    recipe: Recipe
    sampling: SamplingDistribution
    device: torch.device
    all_reduce: AllReduce
    seconds: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    """Time spent in optimizer steps (clip + step) during the current `train` call: the step-time breakdown."""
    reference: torch.nn.Module | None = None
    """The frozen reference policy (`state.build_reference`) whose log-probs the KL-to-reference term needs
    (`recipe.kl_coef` > 0); None without that term."""

    # ------------------------------------------------------------------ the step

    def train(self, shards: Sequence[TrainBatch], step: int) -> StepStats:
        """Step number `step + 1` on this rank's share of each mini-batch of one rollout batch (in order).
        `loss` (mean over updates) and `grad_norm` (mean pre-clip norm) are global; samples, tokens and
        metrics are this rank's (the pool merges them)."""
        # VAPO-style value pre-training: a random value head gives random GAE advantages (with short
        # answers the length-adaptive lambda is clamped to 0, so advantages are pure TD errors), which
        # drive the policy down. The policy waits until the critic has seen `critic_warmup_steps` batches.
        frozen = self.state.critic is not None and step < self.config.critic_warmup_steps
        lr = self.state.optimizer.param_groups[0]["lr"]
        began, self.seconds["optimizer"] = time.perf_counter(), 0.0
        if len(shards) == 1 and self.config.epochs == 1:
            loss, grad_norm, metrics = self._one_update(shards[0], frozen)
        else:
            loss, grad_norm, metrics = self._updates(shards, frozen)
        return StepStats(
            step=step + 1,
            loss=loss,
            grad_norm=grad_norm,
            num_samples=sum(s.num_rows for s in shards),
            num_tokens=sum(s.num_tokens for s in shards),
            metrics=dict(
                metrics,
                lr=lr,
                policy_frozen=float(frozen),
                loss_tokens=float(sum(s.num_loss_tokens for s in shards)),
                **self._timings(began),
            ),
        )

    def _timings(self, began: float) -> dict[str, float]:
        """This step's seconds in optimizer steps and in everything else (forward and backward passes)."""
        optimizer_s = self.seconds["optimizer"]
        return {"time_optimizer_s": optimizer_s, "time_forward_backward_s": time.perf_counter() - began - optimizer_s}

    def _one_update(self, rows: TrainBatch, frozen: bool) -> tuple[float, float, dict[str, float]]:
        """The single-update step: pi_old is the update's own forward (rho = 1 in value)."""
        acc = self.accumulate(rows, policy=not frozen)
        if frozen:
            grad_norm, stepped = 0.0, False
        else:
            grad_norm, stepped = self._clip_and_step(self.state.policy, self.state.optimizer, self.state.scheduler)
        metrics = dict(
            acc.metrics, skipped_step=float(not stepped and not frozen), updates=float(stepped), kl_stopped=0.0
        )
        if self.state.critic is not None and acc.batch.returns is not None:
            metrics.update(self._critic_step(acc.batch, self.state.critic_scheduler))
        return acc.loss, grad_norm, metrics

    def _updates(self, shards: Sequence[TrainBatch], frozen: bool) -> tuple[float, float, dict[str, float]]:
        """`epochs` passes over the mini-batches, one policy update (and one critic step) each, all against
        the pi_old and advantages of before the first update; the schedulers advance once."""
        batches = self._prepare(shards, policy=not frozen)
        updates: list[Update] = []
        critic: list[dict[str, float]] = []
        for batch in [b for _ in range(self.config.epochs) for b in batches]:
            if not frozen:
                updates.append(self._policy_update(batch, may_stop=bool(updates)))
                if updates[-1].stopped:
                    break
            if self.state.critic is not None and batch.returns is not None:
                critic.append(self._critic_step(batch, None))
        if any(u.stepped for u in updates):
            self.state.scheduler.step()
        critic_scheduler = self.state.critic_scheduler
        if critic_scheduler is not None and any(not c["critic_skipped_step"] for c in critic):
            critic_scheduler.step()
        taken = [u for u in updates if not u.stopped]
        # update_metrics' global approx_kl (of the last update) replaces this rank's mean over updates.
        metrics = dict(
            mean_over_updates([u.metrics for u in taken]), **mean_over_updates(critic), **update_metrics(updates)
        )
        loss = float(np.mean([u.loss for u in taken])) if taken else 0.0
        grad_norm = float(np.mean([u.grad_norm for u in taken])) if taken else 0.0
        return loss, grad_norm, metrics

    def _policy_update(self, batch: MiniBatch, may_stop: bool) -> Update:
        """Backward of one mini-batch, then the optimizer step, unless `may_stop` and its global approx-KL
        (measured in this forward, before the step) exceeds `learner.kl_stop`."""
        loss, metrics = self._policy_backward(batch)
        tokens = float(batch.loss_tokens)
        local = torch.tensor(
            [metrics.get("clipfrac", 0.0) * tokens, metrics.get("approx_kl", 0.0) * tokens, tokens], dtype=torch.float64
        )
        clip_sum, kl_sum, total = self.all_reduce(local, "sum").tolist()
        clipfrac, approx_kl = (clip_sum / total, kl_sum / total) if total > 0 else (0.0, 0.0)
        if may_stop and self.config.kl_stop is not None and approx_kl > self.config.kl_stop:
            self.state.optimizer.zero_grad(set_to_none=True)
            return Update(loss, 0.0, False, clipfrac, approx_kl, metrics, stopped=True)
        grad_norm, stepped = self._clip_and_step(self.state.policy, self.state.optimizer, None)
        return Update(loss, grad_norm, stepped, clipfrac, approx_kl, metrics)

    def gradients(self, rows: TrainBatch) -> tuple[float, dict[str, np.ndarray]]:
        """(batch loss, full unsharded policy gradient by Hugging Face name) without stepping; collective. A policy
        that joins its own gradient (megatron's `full_hf_grads`: data-parallel sum, TP pieces joined) gives that."""
        from asyncrl.learner.policy import hf_name

        acc = self.accumulate(rows)
        grads = {}
        joined = getattr(self.state.policy, "full_hf_grads", None)
        if joined is not None:
            grads = {name: grad.float().numpy() for name, grad in joined().items()}
            self.state.optimizer.zero_grad(set_to_none=True)
            return acc.loss, grads
        for name, param in self.state.policy.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[hf_name(name)] = grad.detach().float().cpu().numpy()
        self.state.optimizer.zero_grad(set_to_none=True)
        return acc.loss, grads

    def accumulate(self, rows: TrainBatch, policy: bool = True) -> Accumulated:
        """Backward of the policy loss of this rank's rows, pi_old = this forward (gradients accumulate, no
        step). With `policy=False` only the critic's advantages and returns are computed."""
        mbs, real = self._micro_batches(rows)
        (advantages,), (returns,) = self._rollout_advantages([mbs])
        if not policy:
            return Accumulated(0.0, {}, MiniBatch(mbs, real, advantages, returns, [], [], None))
        if self.recipe.denominator_after_rejection or self.recipe.normalizes_tis:
            batch = self._with_old(mbs, real, advantages, returns)
        else:
            batch = MiniBatch(mbs, real, advantages, returns, [None] * len(mbs), [mb.token_weights for mb in mbs], None)
        loss, metrics = self._policy_backward(batch)
        return Accumulated(loss, metrics, batch)

    def _prepare(self, shards: Sequence[TrainBatch], policy: bool) -> list[MiniBatch]:
        """Every mini-batch's micro-batches, advantages and (unless the policy is frozen) pi_old, all from
        the weights before the first update."""
        packed = [self._micro_batches(s) for s in shards]
        advantages, returns = self._rollout_advantages([mbs for mbs, _ in packed])
        return [
            self._with_old(mbs, real, adv, ret) if policy else MiniBatch(mbs, real, adv, ret, [], [], None)
            for (mbs, real), adv, ret in zip(packed, advantages, returns, strict=True)
        ]

    def _with_old(self, mbs: list[TrainBatch], real: int, advantages: list[torch.Tensor], returns) -> MiniBatch:
        """A mini-batch with pi_old (a no-grad pass) and what depends only on it: the weights after
        rejection and the TIS normaliser, each summed over every micro-batch of every rank."""
        with torch.no_grad():
            old = [self._logprobs(mb) for mb in mbs]
        ref = [self._reference_logprobs(mb) for mb in mbs]  # once per batch, whatever the number of updates
        # A token outside pi_old's kept set (-inf) counts in these statistics with a ratio of 1 to mu.
        finite = [torch.where(torch.isfinite(o), o, mb.rollout_logprobs) for mb, o in zip(mbs, old, strict=True)]
        weights = (
            self._weights_after_rejection(mbs, real, finite)
            if self.recipe.denominator_after_rejection
            else [mb.token_weights for mb in mbs]
        )
        tis_stats = self._tis_stats(mbs[:real], finite[:real]) if self.recipe.normalizes_tis else None
        return MiniBatch(mbs, real, advantages, returns, old, weights, tis_stats, ref)

    def _tis_stats(self, mbs: list[TrainBatch], old: list[torch.Tensor]) -> torch.Tensor:
        """(sum of truncated TIS weights, valid tokens) over the whole optimizer batch: every micro-batch of
        every rank, so batch-normalised TIS divides by the same mean whatever the split."""
        from asyncrl.algo.recipes import tis_normalizer_stats

        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for mb, o in zip(mbs, old, strict=True):
            stats += tis_normalizer_stats(self.recipe, mb.loss_mask, o, mb.rollout_logprobs).to(self.device)
        return self.all_reduce(stats, "sum")

    def _policy_backward(self, batch: MiniBatch) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch; -> (global batch loss, this rank's metrics). `approx_kl`
        is k3 of KL(pi_old || pi_theta), the mean over loss tokens (0 when pi_old is this forward); `kl_ref`
        (with a reference) the recipe's KL estimator of KL(pi_theta || pi_ref), the mean over loss tokens."""
        from asyncrl.algo.kl import kl_penalty
        from asyncrl.algo.recipes import compute_policy_loss

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts, old_seen = [], []
        for i, mb in enumerate(batch.micro_batches):
            learner_logprobs = self._logprobs(mb)
            old = batch.old[i]
            ref = batch.ref[i] if batch.ref else self._reference_logprobs(mb)
            logprobs = [learner_logprobs, old if old is not None else learner_logprobs.detach()]
            mask, weights, (learner_logprobs, old_logprobs, *refs) = self._supported(
                mb, batch.weights[i], logprobs + ([] if ref is None else [ref])
            )
            ref = refs[0] if refs else None
            loss, metrics = compute_policy_loss(
                self.recipe,
                learner_logprobs,
                old_logprobs,
                mb.rollout_logprobs,
                batch.advantages[i],
                mask,
                weights,
                mb.group_ids,
                ref_logprobs=ref,
                tis_stats=batch.tis_stats,
            )
            loss.backward()
            loss_sum += loss.detach().double()
            if i < batch.real:
                kl = kl_penalty(old_logprobs, learner_logprobs.detach(), mask, "k3")
                metrics["approx_kl"] = float(kl.double().sum()) / max(mb.num_loss_tokens, 1)
                if ref is not None:
                    kl = kl_penalty(learner_logprobs.detach().double(), ref.double(), mask, self.recipe.kl_estimator)
                    metrics["kl_ref"] = float(kl.double().sum()) / max(mb.num_loss_tokens, 1)
                if self.sampling.truncates:
                    dropped = int(mb.loss_mask.bool().sum()) - int(mask.sum())
                    metrics["outside_support_frac"] = dropped / max(mb.num_loss_tokens, 1)
                parts.append((metrics, float(mb.num_loss_tokens)))
                old_seen.append((old_logprobs, mb.rollout_logprobs, mask.long(), mb.lags))
        metrics = merge_metrics(parts)
        metrics.update(self._mismatch(old_seen))
        return float(self.all_reduce(loss_sum, "sum").item()), metrics

    def _supported(
        self, mb: TrainBatch, weights: torch.Tensor, logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(loss mask, reduction weights, `logprobs`: learner, old [, reference]) without the tokens that any of
        them gives probability 0 under top-k / top-p (`algo.sampling.in_support`); unchanged without truncation."""
        if not self.sampling.truncates:
            return mb.loss_mask, weights, logprobs
        mask, logprobs = in_support(mb.loss_mask, logprobs)
        return mask, torch.where(mask, weights, torch.zeros_like(weights)), logprobs

    def _mismatch(
        self, seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    ) -> dict[str, float]:
        """`mismatch_*` metrics of (old, rollout log-probs, loss mask, row lags) over this rank's real
        micro-batches, plus their per-lag pieces when every row's lag is known (the pool divides them)."""
        from asyncrl.algo.metrics import lag_mismatch_parts, mismatch_metrics
        from asyncrl.algo.recipes import correction_keep

        if not seen or not any(int(m.sum()) for _, _, m, _ in seen):
            return {}
        olds = pad_cat([old for old, _, _, _ in seen])
        rollouts = pad_cat([rollout for _, rollout, _, _ in seen])
        masks = pad_cat([mask for _, _, mask, _ in seen])
        out = {
            f"mismatch_{k}": v for k, v in mismatch_metrics(olds, rollouts, masks.bool(), self.recipe.tis_cap).items()
        }
        known = [lags for *_, lags in seen if lags is not None]
        if len(known) == len(seen):
            lags = torch.cat(known)
            keep = correction_keep(self.recipe, olds, rollouts, masks.bool())
            out.update(lag_mismatch_parts(olds, rollouts, masks.bool(), lags, self.recipe.tis_cap, keep))
        return out

    def _clip_and_step(self, module, optimizer, scheduler) -> tuple[float, bool]:
        """Clip to `grad_clip`, step (and the `scheduler` unless None) unless the norm is not finite;
        -> (pre-clip norm, stepped)."""
        began = time.perf_counter()
        # A backend that reduces its gradients itself clips them itself (megatron: `MegatronPolicy.clip_grad_norm_`).
        own = getattr(module, "clip_grad_norm_", None)
        total = (
            own(self.config.grad_clip)
            if own
            else torch.nn.utils.clip_grad_norm_(module.parameters(), self.config.grad_clip)
        )
        if hasattr(total, "full_tensor"):  # a DTensor under FSDP2
            total = total.full_tensor()
        norm = float(total)
        stepped = bool(np.isfinite(norm))
        if stepped:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.seconds["optimizer"] = self.seconds.get("optimizer", 0.0) + time.perf_counter() - began
        return norm, stepped

    def _critic_step(self, batch: MiniBatch, scheduler) -> dict[str, float]:
        """One value step on `batch` (its returns fixed before the step's first update)."""
        from asyncrl.algo.recipes import compute_value_loss

        if batch.returns is None:
            raise ValueError("a critic step needs the batch's value targets (a critic advantage estimator)")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = []
        for i, (mb, returns) in enumerate(zip(batch.micro_batches, batch.returns, strict=True)):
            loss, metrics = compute_value_loss(self._values(mb), returns, mb.loss_mask, mb.value_weights)
            loss.backward()
            loss_sum += loss.detach().double()
            if i < batch.real:
                parts.append((metrics, float(mb.num_loss_tokens)))
        norm, stepped = self._clip_and_step(self.state.critic, self.state.critic_optimizer, scheduler)
        metrics = {f"critic_{k}": v for k, v in merge_metrics(parts).items() if k != "value_loss"}
        metrics.update(
            critic_value_loss=float(self.all_reduce(loss_sum, "sum").item()),
            critic_grad_norm=norm,
            critic_skipped_step=float(not stepped),
        )
        return metrics

    # ------------------------------------------------------------------ forward helpers and micro-batches

    def _logprobs(self, mb: TrainBatch) -> torch.Tensor:
        """The policy's log-probs; an MoE policy routes as the engine did where the rows carry routes (R3)."""
        from asyncrl.learner.routing import replaying

        routes = mb.routed_experts if mb.layout is None else mb.layout.routed_experts
        with replaying(self.state.policy, routes):
            return self.state.policy(mb.input_ids, mb.attention_mask, mb.position_ids, self.sampling, mb.layout)

    def _reference_logprobs(self, mb: TrainBatch, for_reward: bool = False) -> torch.Tensor | None:
        """The frozen reference's log-probs of `mb` under the run's sampling distribution (no gradient), or None
        when the recipe has no KL-to-reference loss term (`for_reward`: no KL-in-reward term); the term without a
        reference is an error. An MoE reference routes with its own routers (the engine's routes are the policy's)."""
        key = "kl_in_reward_coef" if for_reward else "kl_coef"
        if getattr(self.recipe, key) <= 0:
            return None
        if self.reference is None:
            raise ValueError(f"algorithm.params.{key} > 0: this step has no reference policy (state.build_reference)")
        with torch.no_grad():
            return self.reference(mb.input_ids, mb.attention_mask, mb.position_ids, self.sampling, mb.layout)

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        if self.state.critic is None:
            raise ValueError("values need a critic: set learner.critic = true")
        return self.state.critic(mb.input_ids, mb.attention_mask, mb.position_ids, mb.layout)

    @property
    def packs(self) -> bool:
        """Whether micro-batches are packed: `learner.packing` and a transformers policy whose attention takes the
        packed mask (megatron's policy has no `transformer`: it trains padded rows)."""
        transformer = getattr(self.state.policy, "transformer", None)
        return self.config.packing and transformer is not None and packable(transformer) is None

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        moved: dict[str, Any] = {  # every field, tensors (and the packed layout's) on this rank's device
            f.name: (v.to(self.device) if isinstance(v := getattr(mb, f.name), (torch.Tensor, PackedLayout)) else v)
            for f in dataclasses.fields(mb)
        }
        return TrainBatch(**moved)

    def _micro_batches(self, rows: TrainBatch) -> tuple[list[TrainBatch], int]:
        """This rank's micro-batches (packed unless `learner.packing` is off or the model cannot be: `packing.
        packable`) padded with dummies to the largest count over ranks; -> (all, real)."""
        budget, keep_groups = self.config.tokens_per_microbatch, loss_needs_whole_groups(self.recipe)
        if not rows.num_rows:
            mbs: list[TrainBatch] = []
        elif self.packs:
            mbs = packed_micro_batches(rows, budget, self.config.share_group_prompt, keep_groups)
        else:
            mbs = micro_batches(rows, budget, keep_groups)
        count = int(self.all_reduce(torch.tensor([len(mbs)]), "max").item())
        real = len(mbs)
        mbs += [dummy_microbatch(rows.num_groups) for _ in range(count - real)]
        return [self._to_device(mb) for mb in mbs], real

    # ------------------------------------------------------------------ advantages and weights on the rank

    def _rollout_advantages(
        self, packed: list[list[TrainBatch]]
    ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor] | None]]:
        """(advantages, critic returns or None) per mini-batch and micro-batch, from the weights before any
        update: outcome advantages as built, critic ones (whitened) over the whole rollout batch."""
        if self.recipe.advantage not in CRITIC_ADVANTAGES:
            return [[mb.advantages for mb in mbs] for mbs in packed], [None] * len(packed)
        if self.state.critic is None:
            raise ValueError(f"advantage {self.recipe.advantage!r} needs a critic: set learner.critic = true")
        advantages, returns = self._critic_advantages([mb for mbs in packed for mb in mbs])
        return regroup(advantages, packed), list(regroup(returns, packed))

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
                adv, ret = compute_advantages(
                    recipe, self._token_rewards(mb), mb.group_ids, mb.loss_mask, values, mb.dones, bootstrap
                )
                if ret is None:
                    raise ValueError(f"advantage {recipe.advantage!r} gives no value targets for the critic")
                advantages.append(adv.float())
                returns.append(ret.float())
        if self.recipe.whiten_advantages:
            masks = [mb.loss_mask for mb in mbs]
            moments = self.all_reduce(whitening_moments(advantages, masks).to(self.device), "sum")
            advantages = apply_whitening(advantages, masks, moments)
        return advantages, returns

    def _token_rewards(self, mb: TrainBatch) -> torch.Tensor:
        """The outcome rewards of `mb` on their last response tokens [B, T]; with `kl_in_reward_coef` (beta) each
        loss token also gets -beta * (log pi_old - log pi_ref) (`algo.kl.kl_in_reward`), pi_old being the policy
        before the step's first update. A token outside either kept set (top-k / top-p) gets no KL reward."""
        from asyncrl.algo.advantages import outcome_to_token_rewards
        from asyncrl.algo.kl import kl_in_reward

        rewards = outcome_to_token_rewards(mb.rewards, mb.loss_mask.bool())
        ref = self._reference_logprobs(mb, for_reward=True)
        if ref is None:
            return rewards
        old = self._logprobs(mb)
        mask, _, (old, ref) = self._supported(mb, mb.token_weights, [old, ref])
        return rewards + kl_in_reward(torch.zeros_like(rewards), old, ref, mask, self.recipe.kl_in_reward_coef)

    def _weights_after_rejection(self, mbs: list[TrainBatch], real: int, old: list[torch.Tensor]) -> list[torch.Tensor]:
        """Reduction weights whose denominators count tokens kept by the correction (verl convention),
        with the statistics summed over every micro-batch of every rank before any backward."""
        from asyncrl.algo.recipes import denominator_mask
        from asyncrl.algo.reduction import reduction_stats, reduction_weights

        masks = [
            denominator_mask(self.recipe, mb.loss_mask, o, mb.rollout_logprobs) for mb, o in zip(mbs, old, strict=True)
        ]
        num_groups = mbs[0].num_groups if mbs else 1
        stats = torch.zeros(3 + num_groups, dtype=torch.int64, device=self.device)
        for mb, mask in zip(mbs[:real], masks[:real], strict=True):  # dummies must not count as sequences
            stats += reduction_stats(mask, mb.group_ids, num_groups)
        stats = self.all_reduce(stats, "sum")
        return [
            reduction_weights(self.recipe.reduction, m, mb.group_ids, self.recipe.l_max, stats)
            if i < real
            else mb.token_weights
            for i, (mb, m) in enumerate(zip(mbs, masks, strict=True))
        ]
