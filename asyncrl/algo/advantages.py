"""Advantage estimators: REINFORCE baseline, GAE, VAPO, and the group family (GRPO and friends).

Papers:
- GAE: Schulman et al. 2015, https://arxiv.org/abs/1506.02438
- VAPO: Yue et al. 2025, https://arxiv.org/abs/2504.05118
- GRPO: Shao et al. 2024, https://arxiv.org/abs/2402.03300
- Dr. GRPO: Liu et al. 2025, https://arxiv.org/abs/2503.20783
- RLOO: Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740
- REINFORCE++: Hu et al. 2025, https://arxiv.org/abs/2501.03262
- ScaleRL batch normalisation: Khatri et al. 2025, https://arxiv.org/abs/2510.13786
- MaxRL: Tajwar et al. 2026, https://arxiv.org/abs/2602.02710

Formulas: docs/algorithms.md#advantages. Everything here is a constant for the loss: inputs are
detached and computed in fp32 (float64 inputs stay float64).

Where this departs from the papers / reference code:
- Group size 1 gives A = 0 for grpo, dr_grpo, rloo, batch_norm, maxrl and the REINFORCE++ baseline
  (verl returns R/(1+eps) for GRPO and R for RLOO; slime returns NaN).
- Groups whose rewards are all equal get A = 0 exactly, not the ~1e-11 round-off of R - mean.
- GAE takes `dones` and `bootstrap_values`: a truncated sequence bootstraps from V(s_T); verl always
  treats the end as terminal.
- VAPO's length-adaptive lambda 1 - 1/(alpha*l) is clamped to [0, 1] (negative for l < 1/alpha).
- MaxRL: `maxrl(..., divide_by_group_size=True)` is the survey's weight (r - r_hat)/(N r_hat), meant for a
  sum over samples. With `divide_by_group_size=False` it is prime-rl's (r - r_hat)/r_hat, meant for a mean
  over samples; the `maxrl` recipe uses that one because every asyncrl reduction averages over samples.
- Statistics (REINFORCE++ whitening, ScaleRL batch std) are over the tensors passed in; the caller must
  pass the whole optimizer batch (or the global `batch_std`).
"""

from __future__ import annotations

import torch

from asyncrl.algo._masked import as_mask, dense_groups, fp32, group_sum, masked_mean, valid

__all__ = [
    "batch_normalized",
    "broadcast_to_tokens",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "grpo",
    "masked_whiten",
    "maxrl",
    "outcome_to_token_rewards",
    "reinforce_baseline",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "vapo",
    "vapo_policy_lambda",
]


# ---------------------------------------------------------------------------------------------
# Token-level helpers
# ---------------------------------------------------------------------------------------------


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence values [N] -> [N, T], zero at masked positions."""
    mask = as_mask(mask)
    v = fp32(seq_values).detach()[:, None].expand(mask.shape)
    return torch.where(mask, v, 0.0)


def outcome_to_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards [N] placed on the last valid token of each row -> [N, T]. Empty rows get none."""
    mask = as_mask(mask)
    rewards = fp32(rewards).detach()
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(mask, positions, -1).amax(-1)
    has_token = last >= 0
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    value = torch.where(has_token, rewards, 0.0)
    return out.scatter(1, last.clamp(min=0)[:, None], value[:, None])


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """`G_t = sum_{s>=t} gamma^(s-t) r_s` over valid tokens; masked positions are skipped and get 0.

    token_rewards: [B, T]; mask: [B, T] -> [B, T].
    """
    mask = as_mask(mask)
    r = valid(token_rewards, mask).detach()
    if gamma == 1.0:
        returns = r.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask, returns, 0.0)
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(mask, returns, 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten x over all valid entries: `(x - mean) / sqrt(var_unbiased + eps)`, 0 at masked positions.

    x, mask: [B, T]. With fewer than 2 valid entries the variance is undefined and the result is
    `x - mean` (i.e. 0) rather than NaN. `shift_mean=False` adds the mean back (verl convention).
    """
    mask = as_mask(mask)
    x = valid(x, mask).detach()
    count = mask.sum()
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, 0.0)
    var = (centered**2).sum() / (count - 1).clamp(min=1)
    scale = torch.rsqrt(var + eps) if count >= 2 else torch.zeros_like(var)
    out = centered * scale
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, 0.0)


# ---------------------------------------------------------------------------------------------
# REINFORCE, GAE, VAPO
# ---------------------------------------------------------------------------------------------


def reinforce_baseline(rewards: torch.Tensor, baseline: float | torch.Tensor = 0.0) -> torch.Tensor:
    """`A = R - b` (docs/algorithms.md#reinforce). rewards: [N] (or per-token returns [N, T]); baseline
    broadcastable."""
    b = baseline.detach() if isinstance(baseline, torch.Tensor) else baseline
    return fp32(rewards).detach() - b


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    dones: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens (docs/algorithms.md#gae).

    rewards: [B, T] per-token rewards; values: [B, T] critic values V(s_t); mask: [B, T].
    lam: float or per-sequence [B] (VAPO). dones: [B] bool, True = terminal (EOS), False = truncated;
    None means all terminal. bootstrap_values: [B] V(s_T) after the last token, used where not done.
    Returns (advantages [B, T], returns [B, T] = advantages + values), both 0 at masked positions.

    Masked positions (e.g. tool-output tokens of a multi-turn episode) are skipped: the next value and
    the running GAE are carried across them unchanged, as in verl.
    """
    mask = as_mask(mask)
    r = valid(rewards, mask).detach()
    v = valid(values, mask).detach()
    batch = r.shape[0]
    if dones is None:
        dones = torch.ones(batch, dtype=torch.bool, device=r.device)
    if bootstrap_values is None:
        if not bool(dones.all()):
            raise ValueError("gae: truncated sequences (dones=False) need bootstrap_values")
        bootstrap_values = torch.zeros(batch, dtype=r.dtype, device=r.device)
    boot = fp32(bootstrap_values).detach().to(r.dtype)
    next_value = torch.where(dones.bool(), 0.0, boot)
    lam_t = fp32(lam).detach().to(r.dtype) if isinstance(lam, torch.Tensor) else lam
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam_t * last_gae
        last_gae = torch.where(m, step, last_gae)
        next_value = torch.where(m, v[:, t], next_value)
        advantages[:, t] = step
    advantages = torch.where(mask, advantages, 0.0)
    returns = torch.where(mask, advantages + v, 0.0)
    return advantages, returns


def vapo_policy_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """Length-adaptive policy lambda `1 - 1/(alpha*l)` clamped to [0, 1] (docs/algorithms.md#vapo). lengths: [B] -> [B].

    The clamp is asyncrl's choice (docs/algorithms.md#vapo): the paper's formula is negative for l < 1/alpha
    (20 tokens at 0.05).
    """
    lengths = fp32(lengths).detach()
    # l = 0 gives -inf, which the clamp maps to 0.
    lam = 1.0 - 1.0 / (alpha * lengths)
    return lam.clamp(0.0, 1.0)


def vapo(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 0.05,
    critic_lam: float = 1.0,
    dones: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (docs/algorithms.md#vapo): policy advantages with lambda_policy(|y_i|), value targets with
    critic_lam.

    Shapes as `gae`. Returns (advantages [B, T], returns [B, T]).
    """
    mask = as_mask(mask)
    lam_policy = vapo_policy_lambda(mask.sum(-1), alpha)
    advantages, _ = gae(rewards, values, mask, gamma, lam_policy, dones, bootstrap_values)
    _, returns = gae(rewards, values, mask, gamma, critic_lam, dones, bootstrap_values)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Group (outcome) estimators: rewards [N], group_ids [N] int -> per-sequence advantages [N]
# ---------------------------------------------------------------------------------------------


class _Groups:
    """Per-group statistics of outcome rewards; `constant` marks all-equal groups and singletons."""

    def __init__(self, rewards: torch.Tensor, group_ids: torch.Tensor):
        self.rewards = fp32(rewards).detach()
        self.index, num_groups = dense_groups(group_ids)
        r = self.rewards
        self.count = group_sum(torch.ones_like(r), self.index, num_groups)
        self.mean = group_sum(r, self.index, num_groups) / self.count
        self.centered = r - self.mean[self.index]
        fill = torch.full((num_groups,), float("inf"), dtype=r.dtype, device=r.device)
        rmax = (-fill).scatter_reduce(0, self.index, r, "amax")
        rmin = fill.scatter_reduce(0, self.index, r, "amin")
        self.size = self.count[self.index]
        self.constant = (rmax == rmin)[self.index] | (self.size < 2)
        self.num_groups = num_groups

    def std(self, unbiased: bool) -> torch.Tensor:
        """Per-sample std of its group [N]; singletons are guarded to avoid 0/0."""
        ss = group_sum(self.centered**2, self.index, self.num_groups)
        dof = (self.count - 1).clamp(min=1) if unbiased else self.count
        return (ss / dof).sqrt()[self.index]

    def zero_constant(self, a: torch.Tensor) -> torch.Tensor:
        return torch.where(self.constant, 0.0, a)


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, unbiased: bool = True) -> torch.Tensor:
    """`A_i = (R_i - mean_g R) / (std_g R + eps)` with Bessel std by default (docs/algorithms.md#grpo). -> [N]."""
    g = _Groups(rewards, group_ids)
    return g.zero_constant(g.centered / (g.std(unbiased) + eps))


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """`A_i = R_i - mean_g R`, no std division (docs/algorithms.md#dr_grpo). -> [N]."""
    g = _Groups(rewards, group_ids)
    return g.zero_constant(g.centered)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline `R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g R)` (docs/algorithms.md#rloo). -> [N]."""
    g = _Groups(rewards, group_ids)
    return g.zero_constant(g.centered * g.size / (g.size - 1).clamp(min=1))


def batch_normalized(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-4,
    batch_std: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """ScaleRL / TRL `scale_rewards="batch"`: `(R_i - mean_g R) / (std_batch R + eps)`
    (docs/algorithms.md#batch_norm). -> [N].

    std_batch is the Bessel std of the raw rewards of the whole batch (before zero-variance filtering).
    Pass `batch_std` when this process holds only part of the global batch.
    """
    g = _Groups(rewards, group_ids)
    if batch_std is None:
        r = g.rewards
        batch_std = r.std() if r.numel() >= 2 else torch.zeros((), dtype=r.dtype, device=r.device)
    return g.zero_constant(g.centered / (batch_std + eps))


def maxrl(rewards: torch.Tensor, group_ids: torch.Tensor, divide_by_group_size: bool = True) -> torch.Tensor:
    """MaxRL per-sample weight (docs/algorithms.md#maxrl). -> [N]. Rewards must be non-negative (canonically binary).

    divide_by_group_size=True: `w_i = (r_i - r_hat) / (N r_hat)`, N = group size; use it in a SUM over samples.
    divide_by_group_size=False: `A_i = (r_i - r_hat) / r_hat` (prime-rl); use it in a MEAN over samples.
    Groups without any success (r_hat <= 0) get 0.
    """
    g = _Groups(rewards, group_ids)
    r_hat = g.mean[g.index]
    denom = r_hat * g.size if divide_by_group_size else r_hat
    w = g.centered / torch.where(r_hat > 0, denom, torch.ones_like(denom))
    return g.zero_constant(torch.where(r_hat > 0, w, 0.0))


def reinforce_pp(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ (docs/algorithms.md#reinforce_pp): outcome reward on the last token (+ optional per-token rewards
    such as `-beta*k1`), discounted return, then whitening over all valid tokens of the batch.

    rewards: [N]; mask: [N, T]; token_rewards: [N, T] or None. Returns advantages [N, T].
    """
    mask = as_mask(mask)
    r = outcome_to_token_rewards(rewards, mask)
    if token_rewards is not None:
        r = r + valid(token_rewards, mask).detach()
    return masked_whiten(discounted_returns(r, mask, gamma), mask)


def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (docs/algorithms.md#reinforce_pp): subtract the group mean, broadcast, whiten over valid
    tokens.

    rewards: [N]; group_ids: [N]; mask: [N, T]. Returns advantages [N, T].
    """
    return masked_whiten(broadcast_to_tokens(dr_grpo(rewards, group_ids), mask), mask)
