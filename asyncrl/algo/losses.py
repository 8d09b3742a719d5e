"""Policy surrogates (PPO, CISPO, GSPO, SAPO, DPPO, GVPO, REINFORCE) and the critic's value loss.

Papers:
- PPO: Schulman et al. 2017, https://arxiv.org/abs/1707.06347; dual clip: Ye et al. 2020, https://arxiv.org/abs/1912.09729
- DAPO clip-higher: Yu et al. 2025, https://arxiv.org/abs/2503.14476
- CISPO: MiniMax-M1, https://arxiv.org/abs/2506.13585
- GSPO: Zheng et al. 2025, https://arxiv.org/abs/2507.18071
- SAPO: Qwen 2025, https://arxiv.org/abs/2511.20347
- DPPO: Qi et al. 2026, https://arxiv.org/abs/2602.04879
- GVPO: Zhang et al. 2025, https://arxiv.org/abs/2504.19599

Formulas: docs/algorithms.md#losses. Contract of every surrogate:
- returns `(per_token_loss [B, T], metrics)`; the loss is 0 at masked positions and NOT reduced:
  the batch loss is `(per_token_loss * token_weights).sum()` with weights from `reduction.py`;
- only `learner_logprobs` carries gradient; advantages, old/rollout log-probs and every weight are
  detached here, so callers cannot leak gradient through them by accident;
- computed in fp32; -inf/NaN at masked positions never reach the value or the gradient;
- metrics are 0-dim detached tensors (masked means over this call's tokens), converted to floats by
  the caller once per step to avoid a device sync per metric.

Where this departs from the papers / reference code:
- GSPO (sequence form) returns the sequence loss l_i broadcast to each valid token of row i, so that the
  `seq_mean_token_mean` reduction gives the paper's mean over sequences. Its advantage A_i is the masked
  mean of the per-token advantages of row i (equal to A_i when advantages are broadcast per sequence).
- GVPO returns l_i / |y_i| on each valid token, so that summing tokens gives the official sum over groups;
  the `gvpo` preset reduces with `seq_mean_token_sum`, i.e. that sum divided by the number of sequences.
  Groups of size 1 contribute 0 (the official 1/(k-1) is undefined there).
- DPPO's IS cap C defaults to 20 (TRL); verl's actor config would give 3.
"""

from __future__ import annotations

import torch

from asyncrl.algo._masked import (
    as_mask,
    dense_groups,
    fp32,
    group_sum,
    log_ratio,
    masked_mean,
    seq_lengths,
    valid,
)

# verl clamps the GSPO sequence log-ratio at 10 (only from above: exp of a large negative number is 0).
GSPO_LOG_RATIO_MAX = 10.0

Metrics = dict[str, torch.Tensor]

__all__ = [
    "binary_kl",
    "cispo",
    "dppo",
    "dppo_keep_mask",
    "gspo",
    "gspo_token",
    "gvpo",
    "ppo_clip",
    "reinforce",
    "sapo",
    "topk_kl",
    "topk_tv",
    "value_loss",
]


def _zero_pads(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, loss, 0.0)


def _clip_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))` and the mask of tokens where the clip is active."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


# ---------------------------------------------------------------------------------------------
# PPO / DAPO
# ---------------------------------------------------------------------------------------------


def ppo_clip(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and optional dual clip (docs/algorithms.md#ppo).

    learner_logprobs, old_logprobs, advantages, mask: [B, T]. rho = exp(learner - old).
    `l = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high))`, and where A < 0: `min(l, -A c)`.
    Gradient: `-A rho` where unclipped, 0 where clipped or dual-clipped.
    """
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    log_rho = log_ratio(learner_logprobs, old_logprobs.detach(), mask)
    rho = torch.exp(log_rho)
    loss, clipped = _clip_surrogate(rho, adv, eps_low, eps_high)
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        cap = -adv * dual_clip_c
        dual_clipped = (adv < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    metrics = {
        "clipfrac": masked_mean(clipped.float(), mask).detach(),
        "clipfrac_lower": masked_mean(dual_clipped.float(), mask).detach(),
        "ppo_kl": masked_mean(-log_rho, mask).detach(),
    }
    return _zero_pads(loss, mask), metrics


# ---------------------------------------------------------------------------------------------
# CISPO
# ---------------------------------------------------------------------------------------------


def cispo(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float | None = 0.2,
    eps_high: float = 0.28,
    eps_max: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE with a clipped, detached IS weight (docs/algorithms.md#cispo). `l = -sg(w) * A * logp`.

    Shapes [B, T]. Bounds, both conventions:
    - `eps_max` given (TRL / ScaleRL, eps_max = 5): `w = min(rho, eps_max)`, an absolute cap, no lower bound;
    - otherwise (verl / slime): `w = clip(rho, 1-eps_low, 1+eps_high)`; `eps_low=None` means no lower bound
      (canonical MiniMax-M1, same as eps_low >= 1).
    Gradient is `-w * A` at every valid token: no token is dropped. The loss value depends on the logp
    level and is only meaningful through its gradient.
    """
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    logp = valid(learner_logprobs, mask)
    rho = torch.exp(log_ratio(learner_logprobs, old_logprobs, mask)).detach()
    if eps_max is not None:
        w = rho.clamp(max=eps_max)
    else:
        lower = None if eps_low is None else 1.0 - eps_low
        w = rho.clamp(min=lower, max=1.0 + eps_high)
    loss = -w * adv * logp
    metrics = {
        "clipfrac": masked_mean((w != rho).float(), mask),
        "is_weight_mean": masked_mean(w, mask),
    }
    return _zero_pads(loss, mask), metrics


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def _sequence_log_ratio(learner_logprobs, old_logprobs, mask):
    """`log s_i = mean_t (logp - old_logp)` over valid tokens, |y_i| clamped to >= 1. -> [B]."""
    diff = valid(learner_logprobs, mask) - valid(old_logprobs, mask).detach()
    return (diff.sum(-1) / seq_lengths(mask).clamp(min=1)).clamp(max=GSPO_LOG_RATIO_MAX)


def gspo(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO, sequence form (docs/algorithms.md#gspo). `l_i = max(-A_i s_i, -A_i clip(s_i, 1-eps_low, 1+eps_high))`.

    Shapes [B, T]; advantages may be [B] or [B, T] (then A_i = masked mean of row i).
    `s_i` is the geometric mean of rho over the valid tokens of row i. Returns l_i on every valid token of
    row i: reduce with `seq_mean_token_mean` for the paper's `mean_i l_i`. Empty rows give 0 everywhere.
    """
    mask = as_mask(mask)
    if advantages.dim() == 1:
        adv_seq = fp32(advantages).detach()
    else:
        adv_seq = masked_mean(advantages.detach(), mask, dim=-1)
    s = torch.exp(_sequence_log_ratio(learner_logprobs, old_logprobs, mask))
    seq_loss, clipped = _clip_surrogate(s, adv_seq, eps_low, eps_high)
    nonempty = mask.any(-1)
    loss = _zero_pads(seq_loss[:, None].expand(mask.shape), mask)
    metrics = {
        "clipfrac": masked_mean(clipped.float(), nonempty).detach(),
        "seq_ratio_mean": masked_mean(s, nonempty).detach(),
    }
    return loss, metrics


def gspo_token(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (verl's GSPO, docs/algorithms.md#gspo): per-token advantages with a sequence-level ratio.

    `log s_it = sg(log s_i) + logp_t - sg(logp_t)`: forward value s_i, gradient s_i w.r.t. logp_t, so the
    clip decision is taken per sequence. Shapes [B, T]. Reduce with `seq_mean_token_mean` (verl forces it);
    with advantages shared per sequence this equals `gspo` in value and gradient.
    """
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    logp = valid(learner_logprobs, mask)
    log_s = _sequence_log_ratio(learner_logprobs, old_logprobs, mask).detach()
    s_token = torch.exp(log_s[:, None] + logp - logp.detach())
    loss, clipped = _clip_surrogate(s_token, adv, eps_low, eps_high)
    metrics = {
        "clipfrac": masked_mean(clipped.float(), mask).detach(),
        "seq_ratio_mean": masked_mean(torch.exp(log_s), mask.any(-1)).detach(),
    }
    return _zero_pads(loss, mask), metrics


# ---------------------------------------------------------------------------------------------
# SAPO
# ---------------------------------------------------------------------------------------------


def sapo(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO soft gate (docs/algorithms.md#sapo): `l = -A * sigmoid(tau (rho - 1)) * 4 / tau`,
    tau = tau_pos if A > 0 else tau_neg.

    Shapes [B, T]. The gradient weight `4 s (1-s) rho` is exactly 1 at rho = 1 and decays smoothly.
    """
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    rho = torch.exp(log_ratio(learner_logprobs, old_logprobs.detach(), mask))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (rho - 1.0)) * 4.0 / tau
    loss = -gate * adv
    metrics = {"gate_mean": masked_mean(gate, mask).detach(), "ratio_mean": masked_mean(rho, mask).detach()}
    return _zero_pads(loss, mask), metrics


# ---------------------------------------------------------------------------------------------
# DPPO
# ---------------------------------------------------------------------------------------------


def binary_kl(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(mu || p) of the Bernoulli {sampled token, rest}; inputs are log-probs, output same shape.

    `D = mu log(mu/p) + (1-mu) log((1-mu)/(1-p))`; the 1e-8 in the second log follows Stable-RL and keeps
    it finite when a probability reaches 1.
    """
    logp, logmu = fp32(learner_logprobs), fp32(rollout_logprobs)
    p, mu = torch.exp(logp), torch.exp(logmu)
    return mu * (logmu - logp) + (1.0 - mu) * torch.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))


def topk_tv(rollout_topk_probs: torch.Tensor, learner_topk_probs: torch.Tensor) -> torch.Tensor:
    """Total variation over the (K+1)-bucket distribution {top-K tokens of mu, rest} (docs/algorithms.md#dppo_tv).

    rollout_topk_probs: [..., K] mu's top-K probabilities; learner_topk_probs: [..., K] the current
    policy's probabilities of the same token ids. Returns [...].
    """
    mu, p = fp32(rollout_topk_probs), fp32(learner_topk_probs)
    rest_mu, rest_p = 1.0 - mu.sum(-1), 1.0 - p.sum(-1)
    return 0.5 * ((mu - p).abs().sum(-1) + (rest_mu - rest_p).abs())


def topk_kl(rollout_topk_probs: torch.Tensor, learner_topk_probs: torch.Tensor) -> torch.Tensor:
    """KL(mu || p) over the (K+1)-bucket distribution; masses clamped at 1e-12 (Stable-RL). [..., K] -> [...]."""
    mu, p = fp32(rollout_topk_probs).clamp(min=1e-12), fp32(learner_topk_probs).clamp(min=1e-12)
    rest_mu = (1.0 - fp32(rollout_topk_probs).sum(-1)).clamp(min=1e-12)
    rest_p = (1.0 - fp32(learner_topk_probs).sum(-1)).clamp(min=1e-12)
    return (mu * (mu / p).log()).sum(-1) + rest_mu * (rest_mu / rest_p).log()


def dppo_keep_mask(
    divergence: torch.Tensor,
    learner_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta_low: float,
    delta_high: float,
) -> torch.Tensor:
    """DPPO trust-region mask (docs/algorithms.md#dppo_tv): drop a token when it moved in the risky direction too far.

    divergence: [B, T] (binary TV = |p - mu|, binary KL, or a top-K TV/KL). Dropped where
    `A > 0 & p > mu & D > delta_high` or `A <= 0 & p < mu & D > delta_low`. Returns keep [B, T] bool.
    """
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    up = valid(learner_logprobs, mask).detach() > valid(rollout_logprobs, mask).detach()
    down = valid(learner_logprobs, mask).detach() < valid(rollout_logprobs, mask).detach()
    d = valid(divergence, mask).detach()
    drop = ((adv > 0) & up & (d > delta_high)) | ((adv <= 0) & down & (d > delta_low))
    return mask & ~drop


def dppo(
    learner_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    divergence: str | torch.Tensor = "binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    clip_c: float = 20.0,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO (docs/algorithms.md#dppo_tv): `l = -A * sg(min(q, C)) * keep * logp`, q = exp(logp - rollout_logp).

    Shapes [B, T]. The trust region is anchored at the rollout policy mu (pass old_logprobs as
    `rollout_logprobs` for the "_recompute" variant). divergence: "binary_tv", "binary_kl", or a
    precomputed [B, T] tensor (e.g. `topk_tv`/`topk_kl`). Deltas default to 0.15 (TV) / 0.05 (KL).
    """
    mask = as_mask(mask)
    if isinstance(divergence, str):
        if divergence not in ("binary_tv", "binary_kl"):
            raise ValueError(f"unknown DPPO divergence {divergence!r}; valid: binary_tv, binary_kl, or a tensor")
        default_delta = 0.15 if divergence == "binary_tv" else 0.05
        lp, mu = valid(learner_logprobs, mask).detach(), valid(rollout_logprobs, mask)
        if divergence == "binary_tv":
            d = (torch.exp(lp) - torch.exp(mu)).abs()
        else:
            d = binary_kl(lp, mu)
    else:
        if delta_low is None or delta_high is None:
            raise ValueError("dppo: a precomputed divergence tensor needs explicit delta_low and delta_high")
        default_delta = 0.0
        d = divergence
    delta_low = default_delta if delta_low is None else delta_low
    delta_high = default_delta if delta_high is None else delta_high
    adv = valid(advantages, mask).detach()
    logp = valid(learner_logprobs, mask)
    keep = dppo_keep_mask(d, learner_logprobs, rollout_logprobs, adv, mask, delta_low, delta_high)
    q = torch.exp(log_ratio(learner_logprobs, rollout_logprobs, mask)).detach()
    w = torch.where(keep, q.clamp(max=clip_c), 0.0)
    loss = -adv * w * logp
    metrics = {
        "masked_fraction": masked_mean((mask & ~keep).float(), mask),
        "divergence_mean": masked_mean(valid(d, mask).detach(), mask),
        "is_clipfrac": masked_mean((q > clip_c).float(), mask),
    }
    return _zero_pads(loss, mask), metrics


# ---------------------------------------------------------------------------------------------
# GVPO
# ---------------------------------------------------------------------------------------------


def gvpo(
    learner_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, Metrics]:
    """GVPO (docs/algorithms.md#gvpo): `L_g = 1/(k-1) sum_{i in g} 0.5 ((R_theta(i) - mean_g sg(R_theta)) - adv_i)^2`.

    Shapes [B, T]; group_ids [B]; advantages [B] or [B, T] (Dr.GRPO advantages; A_i = row mean).
    `R_theta(i) = beta * sum_t (logp - old_logp)`. Returns `l_i / |y_i|` on each valid token of row i,
    so the token sum is the official sum over groups. The whole group must be in the same optimizer
    batch; groups of one contribute 0. Gradient: `beta * res_i / (k-1)` at every valid token.
    """
    mask = as_mask(mask)
    if advantages.dim() == 1:
        adv_seq = fp32(advantages).detach()
    else:
        adv_seq = masked_mean(advantages.detach(), mask, dim=-1)
    diff = valid(learner_logprobs, mask) - valid(old_logprobs, mask).detach()
    implicit_reward = beta * diff.sum(-1)
    index, num_groups = dense_groups(group_ids)
    count = group_sum(torch.ones_like(adv_seq), index, num_groups)
    size = count[index]
    # The official code uses the detached group mean; the residuals sum to 0 per group, so the gradient
    # is the same either way.
    group_mean = (group_sum(implicit_reward.detach(), index, num_groups) / count)[index]
    residual = implicit_reward - group_mean - adv_seq
    seq_loss = 0.5 * residual**2 / (size - 1).clamp(min=1)
    seq_loss = torch.where(size >= 2, seq_loss, 0.0)
    per_token = seq_loss / seq_lengths(mask).clamp(min=1)
    loss = _zero_pads(per_token[:, None].expand(mask.shape), mask)
    metrics = {"residual_abs_mean": masked_mean(residual.abs(), mask.any(-1)).detach()}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# REINFORCE and the value loss
# ---------------------------------------------------------------------------------------------


def reinforce(
    learner_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """Vanilla policy gradient `l = -A * logp` (shapes [B, T]); IS weights or gates (bypass, DIS) come from
    `correction.py` as a detached multiplier, giving `-sg(w) A logp`."""
    mask = as_mask(mask)
    adv = valid(advantages, mask).detach()
    loss = -adv * valid(learner_logprobs, mask)
    return _zero_pads(loss, mask), {}


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Critic loss `0.5 (V - R)^2`, optionally PPO-style clipped around `old_values` (shapes [B, T]).

    With `clip`: `0.5 max((V - R)^2, (old + clamp(V - old, -clip, clip) - R)^2)`.
    """
    mask = as_mask(mask)
    v = valid(values, mask)
    ret = valid(returns, mask).detach()
    loss = 0.5 * (v - ret) ** 2
    clipfrac = torch.zeros((), device=v.device)
    if clip is not None:
        if old_values is None:
            raise ValueError("value_loss: clip needs old_values")
        old = valid(old_values, mask).detach()
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped_loss = 0.5 * (v_clipped - ret) ** 2
        clipfrac = masked_mean((clipped_loss > loss).float(), mask)
        loss = torch.maximum(loss, clipped_loss)
    metrics = {
        "value_clipfrac": clipfrac.detach(),
        "value_mean": masked_mean(v, mask).detach(),
        "value_error_abs_mean": masked_mean((v - ret).abs(), mask).detach(),
    }
    return _zero_pads(loss, mask), metrics
