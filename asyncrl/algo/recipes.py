"""Named recipes: which advantage, surrogate, reduction and correction a run uses, with their numbers,
and the three entry points the learner calls.

A `Recipe` (recipe.py) is resolved once from the config (`resolve_recipe`). Per optimizer step the learner then:

1. `advantages, returns = compute_advantages(recipe, rewards, group_ids, mask, values, dones, bootstrap_values)`
   over the whole batch (group and batch statistics must see the whole batch);
2. `token_weights = compute_token_weights(recipe, mask, group_ids, old_logprobs, rollout_logprobs)` over
   the whole optimizer batch (or with `stats=` all-reduced across ranks, see `reduction.py`);
   with `recipe.normalizes_tis`: `tis_stats = tis_normalizer_stats(recipe, mask, old_logprobs,
   rollout_logprobs)` summed over every micro-batch and rank, like the reduction statistics;
3. per micro-batch (row slices of every tensor):
   `loss, metrics = compute_policy_loss(recipe, learner_logprobs, old_logprobs, rollout_logprobs,
   advantages, mask, token_weights, group_ids, ref_logprobs, tis_stats)` then `loss.backward()`; the
   micro-batch losses sum to the batch loss exactly (multiply by dp_size if the backend averages
   gradients across ranks);
4. with a critic: `compute_value_loss(values, returns, mask, token_weights)`.

`compute_policy_loss` applies correction -> surrogate -> weighted sum: `l = w * keep * l_loss`, with the
correction's detached weight `w` and keep mask; the KL term `kl_coef * k` is reduced with the same
token weights but never multiplied by `w`. Composition rules that are choices of this library:
- `bypass` replaces old_logprobs by rollout_logprobs (two-policy mode, verl); with the `reinforce` loss it
  adds the truncated IS weight min(q, tis_cap), with ratio losses no extra weight (it would double-count).
- `dis` gates q = exp(learner - rollout). Its weight is q divided by the ratio the surrogate already
  carries: q for `reinforce` (the DIS loss -sg(f(q)) A logp), kappa for surrogates built on rho (ppo,
  cispo, gspo*, sapo, gvpo), 1 for dppo (already weighted by q).
- `veto_threshold` (if set) rejects whole sequences with any kappa below it, for every correction.

Papers are cited in the modules implementing each method; formulas: docs/algorithms.md.
"""

from __future__ import annotations

import torch

from asyncrl.algo import advantages as adv_lib
from asyncrl.algo import correction as corr_lib
from asyncrl.algo import losses as loss_lib
from asyncrl.algo import registry
from asyncrl.algo._masked import as_mask
from asyncrl.algo.kl import kl_penalty
from asyncrl.algo.recipe import PARAM_NAMES, TIS_LEVEL, Recipe, resolve_recipe
from asyncrl.algo.reduction import reduction_weights, weighted_sum
from asyncrl.algo.shaping import overlong_penalty

__all__ = [
    "Recipe",
    "compute_advantages",
    "compute_policy_loss",
    "compute_token_weights",
    "compute_value_loss",
    "denominator_mask",
    "resolve_recipe",
    "shape_rewards",
    "tis_normalizer_stats",
]

# Corrections whose keep mask depends only on old and rollout log-probs, so it can be known before the
# backward passes and may shrink the reduction denominator.
_PRECOMPUTABLE_REJECTION = ("mis", "mis_seq", "mis_geo", "icepop", "decoupled")


def shape_rewards(recipe: Recipe, rewards: torch.Tensor, response_lengths: list[int]) -> torch.Tensor:
    """Task rewards [N] plus the recipe's DAPO overlong penalty of each response
    (docs/algorithms.md#reward-shaping-and-filters), before any advantage sees them; `rewards` itself when the
    recipe shapes nothing. response_lengths: tokens [N]."""
    if recipe.overlong_max_length is None:
        return rewards
    max_length, cache_length = recipe.overlong_max_length, recipe.overlong_cache_length
    penalty = [overlong_penalty(n, max_length, cache_length, recipe.overlong_penalty_factor) for n in response_lengths]
    return rewards + torch.tensor(penalty, dtype=rewards.dtype, device=rewards.device)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def compute_advantages(
    recipe: Recipe,
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None,
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [N, T] (0 at masked positions) and value targets [N, T] (critic estimators) or None.

    rewards: [N] outcome rewards (or [N, T] per-token rewards for gae / vapo / reinforce); group_ids: [N];
    mask: [N, T]; values: [N, T] critic values (gae, vapo); dones: [N] bool, False = truncated;
    bootstrap_values: [N] V(s_T) of truncated sequences. Call it on the whole optimizer batch.
    """
    mask = as_mask(mask)
    name = recipe.advantage
    with torch.no_grad():
        if name in ("gae", "vapo"):
            if values is None:
                raise ValueError(f"advantage {name!r} needs critic values")
            token_rewards = rewards if rewards.dim() == 2 else adv_lib.outcome_to_token_rewards(rewards, mask)
            if name == "gae":
                adv, returns = adv_lib.gae(
                    token_rewards, values, mask, recipe.gamma, recipe.lam, dones, bootstrap_values
                )
            else:
                adv, returns = adv_lib.vapo(
                    token_rewards,
                    values,
                    mask,
                    recipe.gamma,
                    recipe.vapo_alpha,
                    recipe.critic_lam,
                    dones,
                    bootstrap_values,
                )
            if recipe.whiten_advantages:
                adv = adv_lib.masked_whiten(adv, mask)
            return adv, returns
        if name == "reinforce":
            adv = adv_lib.reinforce_baseline(rewards, recipe.baseline)
            return (torch.where(mask, adv, 0.0) if adv.dim() == 2 else adv_lib.broadcast_to_tokens(adv, mask)), None
        if name == "reinforce_pp":
            return adv_lib.reinforce_pp(rewards, mask, recipe.gamma), None
        if group_ids is None:
            raise ValueError(f"advantage {name!r} needs group_ids")
        if name == "reinforce_pp_baseline":
            return adv_lib.reinforce_pp_baseline(rewards, group_ids, mask), None
        seq = _SEQUENCE_ADVANTAGES[name](recipe, rewards, group_ids)
        return adv_lib.broadcast_to_tokens(seq, mask), None


# Estimators of one advantage per sequence from its group's outcome rewards [N] (broadcast to its tokens).
_SEQUENCE_ADVANTAGES = {
    "grpo": lambda r, rewards, g: adv_lib.grpo(rewards, g, r.grpo_eps, r.grpo_unbiased),
    "dr_grpo": lambda r, rewards, g: adv_lib.dr_grpo(rewards, g),
    "rloo": lambda r, rewards, g: adv_lib.rloo(rewards, g),
    "batch_norm": lambda r, rewards, g: adv_lib.batch_normalized(rewards, g, r.batch_norm_eps),
    "maxrl": lambda r, rewards, g: adv_lib.maxrl(rewards, g, r.maxrl_divide_by_group_size),
}
# Estimators `compute_advantages` runs by name before the sequence ones (critic, token rewards, no group).
_OTHER_ADVANTAGES = ("gae", "vapo", "reinforce", "reinforce_pp", "reinforce_pp_baseline")


def denominator_mask(
    recipe: Recipe,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mask whose counts form the reduction denominators: `mask`, or `mask & keep` when
    `recipe.denominator_after_rejection` and the correction rejects tokens from old/rollout log-probs."""
    mask = as_mask(mask)
    precomputable = recipe.correction in _PRECOMPUTABLE_REJECTION
    veto = recipe.veto_threshold
    if not recipe.denominator_after_rejection or not (precomputable or veto is not None):
        return mask
    if old_logprobs is None or rollout_logprobs is None:
        raise ValueError("denominator_after_rejection needs old_logprobs and rollout_logprobs")
    if precomputable or veto is None:  # a precomputable keep mask already includes the veto
        _, keep, _ = _correction(recipe, old_logprobs, old_logprobs, rollout_logprobs, None, mask)
        return keep
    log_kappa = corr_lib.detached_log_ratio(old_logprobs, rollout_logprobs, mask)
    return corr_lib.veto_keep(log_kappa, mask, veto)


def compute_token_weights(
    recipe: Recipe,
    mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reduction_weights` of the recipe's reduction over the whole optimizer batch -> [B, T].

    These weights reduce every term (policy gradient, KL, value), so nothing term-specific is folded in:
    the TIS batch normalisation is applied to the policy-gradient term by `compute_policy_loss`.
    Distributed case: pass `stats` from `reduction.global_reduction_stats(denominator_mask(...), ...)`.
    """
    m = denominator_mask(recipe, mask, old_logprobs, rollout_logprobs)
    return reduction_weights(recipe.reduction, m, group_ids, recipe.l_max, stats)


def _tis_weights(recipe: Recipe, log_kappa: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return corr_lib.truncated_is_weights(log_kappa, mask, recipe.tis_cap, TIS_LEVEL[recipe.correction])


def tis_normalizer_stats(
    recipe: Recipe, mask: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor
) -> torch.Tensor:
    """(sum of the truncated TIS weights, number of valid tokens) of these rows, float64 [2].

    Summing the vectors of disjoint row sets (micro-batches, ranks: all-reduce SUM) gives those of their
    union; `compute_policy_loss(..., tis_stats=)` divides the weights by sum / count. Shapes [B, T].
    """
    mask = as_mask(mask)
    log_kappa = corr_lib.detached_log_ratio(old_logprobs, rollout_logprobs, mask)
    w = _tis_weights(recipe, log_kappa, mask)
    return torch.stack([w.double().sum(), mask.sum().double()])


def _batch_normalized(w: torch.Tensor, mask: torch.Tensor, tis_stats: torch.Tensor | None) -> torch.Tensor:
    """TIS weights divided by their batch mean sum / count from `tis_stats`."""
    if tis_stats is None:
        # A mean over this call's rows would silently differ per micro-batch: the caller must say.
        raise ValueError(
            "tis_batch_normalize needs tis_stats: tis_normalizer_stats(...) summed over the whole optimizer batch"
        )
    mean = (tis_stats[0] / tis_stats[1].clamp(min=1)).to(device=w.device, dtype=w.dtype)
    return corr_lib.batch_normalize_weights(w, mask, mean)


def correction_keep(
    recipe: Recipe, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor | None:
    """The tokens the correction keeps at pi_theta = pi_old (the step's first update), for the masked-fraction
    metrics; None when the correction masks nothing or needs the advantages to decide (`opsm`)."""
    if recipe.correction == "opsm":
        return None
    with torch.no_grad():
        _, keep, _ = _correction(recipe, old_logprobs, old_logprobs, rollout_logprobs, None, as_mask(mask))
    return keep


def _correction(recipe, learner_logprobs, old_logprobs, rollout_logprobs, advantages, mask, tis_stats=None):
    """-> (weight [B, T] | None, keep [B, T] | None, metrics). Everything detached."""
    name = recipe.correction
    log_kappa = corr_lib.detached_log_ratio(old_logprobs, rollout_logprobs, mask)
    weight = keep = None
    if name in TIS_LEVEL:
        weight = _tis_weights(recipe, log_kappa, mask)
        if recipe.tis_batch_normalize:
            weight = _batch_normalized(weight, mask, tis_stats)
    elif name in ("mis", "mis_seq", "mis_geo"):
        level = {"mis": "token", "mis_seq": "sequence", "mis_geo": "geometric"}[name]
        weight, keep = corr_lib.masked_is(log_kappa, mask, recipe.mis_upper, recipe.mis_lower, level)
    elif name == "icepop":
        weight, keep = corr_lib.icepop(log_kappa, mask, recipe.icepop_alpha, recipe.icepop_beta)
    elif name == "decoupled":
        weight, keep = corr_lib.decoupled_weights(log_kappa, mask, recipe.decoupled_cap)
    elif name == "dis":
        log_q = corr_lib.detached_log_ratio(learner_logprobs, rollout_logprobs, mask)
        q_weight, keep = corr_lib.dis_gate(log_q, mask, recipe.dis_eps_low, recipe.dis_eps_high)
        if recipe.loss == "reinforce":
            weight = q_weight
        elif recipe.loss in ("dppo_tv", "dppo_kl"):
            weight = keep.float()
        else:
            weight = torch.where(keep, torch.exp(log_kappa), 0.0)
    elif name == "bypass" and recipe.loss == "reinforce":
        log_q = corr_lib.detached_log_ratio(learner_logprobs, rollout_logprobs, mask)
        weight = corr_lib.truncated_is_weights(log_q, mask, recipe.tis_cap, "token")
    elif name == "opsm":
        keep = corr_lib.opsm_keep(learner_logprobs, rollout_logprobs, advantages, mask, recipe.opsm_delta)
    if recipe.veto_threshold is not None:
        veto = corr_lib.veto_keep(log_kappa, mask, recipe.veto_threshold)
        keep = veto if keep is None else keep & veto
        if weight is not None:
            weight = torch.where(keep, weight, 0.0)
    metrics = {}
    count = mask.sum().clamp(min=1)
    if keep is not None:
        metrics["correction_masked_fraction"] = (mask & ~keep).sum() / count
    if weight is not None:
        metrics["correction_weight_mean"] = torch.where(mask, weight, 0.0).sum() / count
    return weight, keep, metrics


_SURROGATES = {
    "ppo": lambda r, lp, old, ro, a, m, g: loss_lib.ppo_clip(lp, old, a, m, r.eps_low, r.eps_high, r.dual_clip_c),
    "cispo": lambda r, lp, old, ro, a, m, g: loss_lib.cispo(lp, old, a, m, r.eps_low, r.eps_high, r.cispo_eps_max),
    "gspo": lambda r, lp, old, ro, a, m, g: loss_lib.gspo(lp, old, a, m, r.eps_low, r.eps_high),
    "gspo_token": lambda r, lp, old, ro, a, m, g: loss_lib.gspo_token(lp, old, a, m, r.eps_low, r.eps_high),
    "sapo": lambda r, lp, old, ro, a, m, g: loss_lib.sapo(lp, old, a, m, r.sapo_tau_pos, r.sapo_tau_neg),
    "dppo_tv": lambda r, lp, old, ro, a, m, g: loss_lib.dppo(
        lp, ro, a, m, "binary_tv", r.dppo_delta_low, r.dppo_delta_high, r.dppo_clip_c
    ),
    "dppo_kl": lambda r, lp, old, ro, a, m, g: loss_lib.dppo(
        lp, ro, a, m, "binary_kl", r.dppo_delta_low, r.dppo_delta_high, r.dppo_clip_c
    ),
    "gvpo": lambda r, lp, old, ro, a, m, g: loss_lib.gvpo(lp, old, a, m, g, r.gvpo_beta),
    "reinforce": lambda r, lp, old, ro, a, m, g: loss_lib.reinforce(lp, a, m),
}


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    if not metrics:
        return {}
    names = list(metrics)
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in names]).tolist()
    return dict(zip(names, values, strict=True))


def compute_policy_loss(
    recipe: Recipe,
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    tis_stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Correction -> surrogate -> weighted sum, for one micro-batch (or the whole batch).

    learner_logprobs (the only input with gradient), old_logprobs, rollout_logprobs, advantages, mask,
    token_weights: [B, T]; group_ids: [B] (gvpo); ref_logprobs: [B, T] (needed when kl_coef > 0).
    token_weights come from `compute_token_weights` over the whole optimizer batch, sliced like the rest.
    tis_stats: `tis_normalizer_stats` of the whole optimizer batch, required when `recipe.normalizes_tis`.
    Returns (scalar fp32 loss, metrics as Python floats).
    """
    mask = as_mask(mask)
    if recipe.loss == "gvpo" and group_ids is None:
        raise ValueError("loss 'gvpo' needs group_ids")
    if recipe.correction == "bypass":
        old_logprobs = rollout_logprobs
    weight, keep, metrics = _correction(
        recipe, learner_logprobs, old_logprobs, rollout_logprobs, advantages, mask, tis_stats
    )
    per_token, loss_metrics = _SURROGATES[recipe.loss](
        recipe, learner_logprobs, old_logprobs, rollout_logprobs, advantages, mask, group_ids
    )
    metrics.update(loss_metrics)
    if weight is not None:
        per_token = per_token * weight
    if keep is not None:
        per_token = torch.where(keep, per_token, 0.0)
    loss = weighted_sum(per_token, token_weights)
    metrics["pg_loss"] = loss.detach()
    if recipe.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = weighted_sum(kl_penalty(learner_logprobs, ref_logprobs, mask, recipe.kl_estimator), token_weights)
        metrics["kl_loss"] = kl.detach()
        loss = loss + recipe.kl_coef * kl
    return loss, _to_floats(metrics)


def compute_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor,
    clip: float | None = None,
    old_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss `sum(0.5 (V - R)^2 * token_weights)`, optionally clipped around old_values. Shapes [B, T]."""
    per_token, metrics = loss_lib.value_loss(values, returns, mask, old_values, clip)
    loss = weighted_sum(per_token, token_weights)
    metrics["value_loss"] = loss.detach()
    return loss, _to_floats(metrics)


def _check_registry() -> None:
    """Every registered parameter is a `Recipe` field, and every registered advantage and loss is implemented here."""
    advantages = {*_OTHER_ADVANTAGES, *_SEQUENCE_ADVANTAGES}
    if advantages != set(registry.ADVANTAGES):
        raise ImportError(f"advantages and registry.ADVANTAGES differ: {sorted(advantages ^ set(registry.ADVANTAGES))}")
    if set(PARAM_NAMES) != set(registry.PARAMS):
        raise ImportError(
            f"Recipe fields and registry.PARAMS differ: {sorted(set(PARAM_NAMES) ^ set(registry.PARAMS))}"
        )
    if set(_SURROGATES) != set(registry.LOSSES):
        raise ImportError(f"surrogates and registry.LOSSES differ: {sorted(set(_SURROGATES) ^ set(registry.LOSSES))}")


_check_registry()
