"""Train-vs-rollout mismatch corrections: TIS, MIS / rejection sampling, IcePop, DIS, AReaL decoupled
PPO, bypass weights and OPSM.

Papers / references:
- TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  https://fengyao.notion.site/off-policy-rl
- MIS / rejection sampling: Liu, Li et al. 2025, "When Speed Kills Stability"; verl rollout correction
  (`rollout_corr_helper.py`, legacy `mismatch_helper.py`)
- IcePop: Ling Team 2025, https://arxiv.org/abs/2510.18855
- DIS: Hou et al. 2026, "Single-Rollout Asynchronous Optimization for Agentic RL", arXiv 2607.07508
- Decoupled PPO: Fu et al. 2025 (AReaL), https://arxiv.org/abs/2505.24298
- OPSM: DeepSeek-V3.2 off-policy sequence masking (TRL `get_off_policy_mask`, slime `compute_opsm_mask`)
Formulas: docs/algorithms.md#corrections.

Every function returns DETACHED per-token tensors [B, T]: a weight `w` (0 at masked positions) and/or a
keep mask. They compose with any surrogate as `l = w * keep * l_loss` (verl multiplies after the dual
clip). Ratios:
    kappa = exp(old_logprobs - rollout_logprobs)      engine mismatch, constant in theta
    q     = exp(learner_logprobs - rollout_logprobs)  current vs behaviour (DIS, bypass)
Log-ratios are clamped to [-20, 20] before exp (verl `SAFETY_BOUND`).

Where this departs from references:
- DIS is the public-reproduction form (`1 - eps_low < q < 1 + eps_high`, weight q), not checked against the
  paper text; every number is a parameter.
- In "mask" mode the ratio gate keeps the untruncated ratio as weight (legacy verl); TRL zeroes it.
- OPSM uses the detached current log-probs (spec); its default delta is 0.5 (TRL's suggestion).
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo._masked import as_mask, log_ratio, masked_mean, seq_lengths, valid

__all__ = [
    "batch_normalize_weights",
    "decoupled_weights",
    "detached_log_ratio",
    "dis_gate",
    "icepop",
    "is_weights",
    "masked_is",
    "opsm_keep",
    "ratio_gate",
    "rejection_keep",
    "truncated_is_weights",
    "veto_keep",
]

LEVELS = ("token", "sequence", "geometric")
RS_STATISTICS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip


def detached_log_ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Clamped, detached `numerator - denominator` [B, T], 0 at masked positions.

    `detached_log_ratio(old, rollout, mask)` is log kappa; `(learner, rollout)` is log q.
    """
    mask = as_mask(mask)
    return log_ratio(numerator.detach(), denominator.detach(), mask)


def _broadcast_rows(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    full = per_row[:, None].expand(mask.shape)
    return torch.where(mask, full, 0.0)


def is_weights(log_ratio_: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Untruncated IS weights [B, T] from a log-ratio [B, T].

    level: "token" exp(log r_t); "sequence" exp(sum_t log r_t) per row; "geometric" exp(mean_t log r_t).
    Sequence sums are clamped to [-20, 20] before exp like token log-ratios.
    """
    mask = as_mask(mask)
    lr = valid(log_ratio_, mask).detach()
    if level == "token":
        return torch.where(mask, torch.exp(lr), 0.0)
    if level == "sequence":
        per_row = lr.sum(-1)
    elif level == "geometric":
        per_row = lr.sum(-1) / seq_lengths(mask).clamp(min=1)
    else:
        raise ValueError(f"unknown IS level {level!r}; valid: {', '.join(LEVELS)}")
    return _broadcast_rows(torch.exp(per_row.clamp(-20.0, 20.0)), mask)


def batch_normalize_weights(
    weights: torch.Tensor, mask: torch.Tensor, global_mean: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Divide weights by their masked mean (verl `rollout_is_batch_normalize`, applied after truncation).

    Pass `global_mean` when this process holds only part of the optimizer batch.
    """
    mask = as_mask(mask)
    mean = masked_mean(weights, mask) if global_mean is None else global_mean
    if isinstance(mean, torch.Tensor):
        mean = torch.where(mean > 0, mean, torch.ones_like(mean))
    elif mean <= 0:
        mean = 1.0
    return torch.where(mask, weights / mean, 0.0).detach()


def truncated_is_weights(
    log_ratio_: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
    batch_normalize: bool = False,
) -> torch.Tensor:
    """TIS (docs/algorithms.md#tis): `w = min(r, C)` per token, or `min(prod_t r_t, C)` per sequence.
    -> [B, T] detached."""
    mask = as_mask(mask)
    w = is_weights(log_ratio_, mask, level).clamp(max=cap)
    return batch_normalize_weights(w, mask) if batch_normalize else w


def ratio_gate(
    ratio: torch.Tensor,
    mask: torch.Tensor,
    lower: float = 0.0,
    upper: float = math.inf,
    mode: str = "mask",
    inclusive: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generic double-sided gate on a ratio [B, T] -> (weight [B, T], keep [B, T] bool), both detached.

    mode "mask": keep tokens with lower <= r <= upper (strict inequalities if not `inclusive`), weight = r.
    mode "truncate": keep every valid token, weight = clamp(r, lower, upper).
    Infinite bounds give the ungated estimator (weight = r, all kept). Weights are 0 where not kept.
    """
    mask = as_mask(mask)
    r = valid(ratio, mask).detach()
    if mode == "mask":
        inside = (r >= lower) & (r <= upper) if inclusive else (r > lower) & (r < upper)
        keep = mask & inside
        weight = r
    elif mode == "truncate":
        keep = mask
        weight = r.clamp(min=lower, max=upper)
    else:
        raise ValueError(f"unknown gate mode {mode!r}; valid: mask, truncate")
    return torch.where(keep, weight, 0.0), keep


def masked_is(
    log_ratio_: torch.Tensor,
    mask: torch.Tensor,
    upper: float = 2.0,
    lower: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS (legacy verl "mask" mode, docs/algorithms.md#mis): keep where lower <= w <= upper, w NOT truncated.

    level: token | sequence | geometric; lower defaults to 1/upper. -> (weight, keep), both [B, T].
    """
    lower = 1.0 / upper if lower is None else lower
    return ratio_gate(is_weights(log_ratio_, mask, level), mask, lower, upper, mode="mask")


def rejection_keep(
    log_kappa: torch.Tensor,
    mask: torch.Tensor,
    statistic: str,
    upper: float,
    lower: float | None = None,
) -> torch.Tensor:
    """verl `rollout_rs` rejection mask (docs/algorithms.md#mis) -> keep [B, T] bool.

    log_kappa = old_logprobs - rollout_logprobs. Token statistics: k1 = -log kappa (note: the inverted
    ratio mu / pi_old), k2 = 0.5 (log kappa)^2, k3 = kappa - 1 - log kappa. `seq_sum_*` / `seq_mean_*` /
    `seq_max_*` aggregate them per row and keep or reject the whole row. k1 keeps
    `log(lower) <= stat <= log(upper)` (lower defaults to 1/upper); k2 and k3 keep `stat <= upper`.
    Combine several statistics with `&`.
    """
    if statistic not in RS_STATISTICS:
        raise ValueError(f"unknown rejection statistic {statistic!r}; valid: {', '.join(RS_STATISTICS)}")
    mask = as_mask(mask)
    lk = valid(log_kappa, mask).detach()
    kind = statistic[-2:]
    if kind == "k1":
        token = -lk
    elif kind == "k2":
        token = 0.5 * lk**2
    else:
        token = torch.exp(lk) - 1.0 - lk
    token = torch.where(mask, token, 0.0)
    if statistic.startswith("token_"):
        stat = token
    elif statistic.startswith("seq_sum_"):
        stat = token.sum(-1)
    elif statistic.startswith("seq_mean_"):
        stat = token.sum(-1) / seq_lengths(mask).clamp(min=1)
    else:  # seq_max: k2 and k3 are >= 0, so 0 at pads never exceeds a real maximum.
        stat = token.amax(-1)
    if kind == "k1":
        lower = 1.0 / upper if lower is None else lower
        inside = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        inside = stat <= upper
    if inside.dim() == 1:
        inside = inside[:, None].expand(mask.shape)
    return mask & inside


def veto_keep(log_kappa: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Reject a whole sequence if any valid token has kappa < threshold (legacy verl veto). -> keep [B, T]."""
    mask = as_mask(mask)
    lk = valid(log_kappa, mask).detach()
    bad = (mask & (lk < math.log(threshold))).any(-1)
    return mask & ~bad[:, None]


def icepop(
    log_kappa: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5, beta: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop (docs/algorithms.md#icepop): `M = kappa if alpha <= kappa <= beta else 0`, per token.
    -> (weight, keep)."""
    return ratio_gate(is_weights(log_kappa, mask, "token"), mask, alpha, beta, mode="mask")


def dis_gate(
    log_q: torch.Tensor, mask: torch.Tensor, eps_low: float = 0.3, eps_high: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DIS double-sided gate (docs/algorithms.md#dis): keep `1 - eps_low < q < 1 + eps_high`, weight q.
    -> (weight, keep).

    log_q = learner_logprobs - rollout_logprobs (detached). With the REINFORCE surrogate this gives the
    DIS loss `-sg(f(q)) A logp`.
    """
    return ratio_gate(is_weights(log_q, mask, "token"), mask, 1.0 - eps_low, 1.0 + eps_high, "mask", inclusive=False)


def decoupled_weights(
    log_kappa: torch.Tensor, mask: torch.Tensor, cap: float | None = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL decoupled PPO behaviour weight (docs/algorithms.md#decoupled): w = kappa, tokens with kappa > cap masked.

    -> (weight, keep). cap=None keeps every token.
    """
    upper = math.inf if cap is None else cap
    return ratio_gate(is_weights(log_kappa, mask, "token"), mask, 0.0, upper, mode="mask")


def opsm_keep(
    learner_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float = 0.5,
) -> torch.Tensor:
    """Off-policy sequence masking (docs/algorithms.md#opsm): drop row i if A_i < 0 and mean_t(rollout - logp) > delta.

    advantages: [B] or [B, T] (A_i = masked row mean). -> keep [B, T] bool.
    """
    mask = as_mask(mask)
    gap = masked_mean(-detached_log_ratio(learner_logprobs, rollout_logprobs, mask), mask, dim=-1)
    adv = advantages.detach().float() if advantages.dim() == 1 else masked_mean(advantages.detach(), mask, dim=-1)
    drop = (adv < 0) & (gap > delta)
    return mask & ~drop[:, None]
