"""KL penalties: k1 / k2 / k3 estimators as loss terms, and KL-in-reward.

References: J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html;
verl `kl_penalty_forward`, slime `compute_approx_kl`. Formulas: docs/algorithms.md#kl-penalties.

With `d = learner_logprobs - ref_logprobs`, exact at any ratio:
    k1 = d                      gradient 1
    k2 = 0.5 d^2                gradient d
    k3 = exp(-d) + d - 1        gradient 1 - exp(-d)   ("low_var_kl", value clamped to [-10, 10])
    k3_plus: value k3, gradient of k2 (verl's straight-through "k3+", unbiased gradient)
`d` itself is never clamped: the tokens that drifted furthest are the ones whose value and gradient matter
most. Only k3's exponential is guarded, exp(-max(d, -20)): exp(-d) overflows fp32 for d < -88, and the
zero gradient of k3's value clamp times inf would be NaN in backward. The guard changes nothing else,
because k3 is above its bound 10 already for d < -2.61 (and for d > 11), where its gradient is 0 anyway.
"""

from __future__ import annotations

import torch

from asyncrl.algo._masked import LOG_RATIO_BOUND, as_mask, log_difference, valid
from asyncrl.algo.registry import KL_ESTIMATORS

__all__ = ["KL_ESTIMATORS", "kl_in_reward", "kl_penalty"]

K3_BOUND = 10.0


def kl_penalty(
    learner_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate [B, T] with gradient through learner_logprobs, 0 at masked positions.

    Reduce it with the same token weights as the policy loss and scale by kl_coef.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    mask = as_mask(mask)
    d = log_difference(learner_logprobs, ref_logprobs.detach(), mask)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d**2
    else:
        guarded_exp = torch.exp(-d.clamp(min=-LOG_RATIO_BOUND))
        k3 = (guarded_exp + d - 1.0).clamp(-K3_BOUND, K3_BOUND)
        if estimator == "k3":
            kl = k3
        else:
            k2 = 0.5 * d**2
            kl = k3.detach() + (k2 - k2.detach())
    return torch.where(mask, kl, 0.0)


def kl_in_reward(
    token_rewards: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """`r_t - beta * k1_t` with k1 = old_logprobs - ref_logprobs (detached), for GAE / REINFORCE++. [B, T]."""
    mask = as_mask(mask)
    k1 = log_difference(old_logprobs.detach(), ref_logprobs.detach(), mask)
    out = valid(token_rewards, mask).detach() - beta * k1
    return torch.where(mask, out, 0.0)
