"""Loss reductions with exact micro-batch / data-parallel equivalence.

References: verl `agg_loss` (token-mean, seq-mean-token-mean, seq-mean-token-sum); Dr. GRPO
(Liu et al. 2025, https://arxiv.org/abs/2503.20783, oat learner `constant_normalizer`); ScaleRL prompt-mean
(Khatri et al. 2025, https://arxiv.org/abs/2510.13786, via slime PR #2090 / AReaL issue #1423).
Formulas: docs/algorithms.md#reductions.

Design: the reduction is a per-token weight matrix computed ONCE over the whole optimizer batch, so
that the batch loss is `(per_token_loss * token_weights).sum()`. Slicing rows of both tensors into
micro-batches or ranks and summing the contributions gives the same loss and gradient, because every
denominator (token count N_tok, non-empty sequence count B', sequence count B, group count P, per-group
token count n_g) was fixed beforehand:

    token_mean               w[i,t] = M / N_tok
    seq_mean_token_mean      w[i,t] = M / (|y_i| B')
    seq_mean_token_sum       w[i,t] = M / B'
    seq_mean_token_sum_norm  w[i,t] = M / (B L_max)        (Dr. GRPO; L_max a fixed config constant)
    prompt_mean              w[i,t] = M / (n_g(i) P)

When the batch is spread over processes: each rank calls `reduction_stats` on its rows, all-reduces the
int64 vector with SUM (or calls `global_reduction_stats`), and passes it as `stats=` to
`reduction_weights`. If the data-parallel backend AVERAGES gradients across ranks (DDP, FSDP), multiply
each rank's loss by dp_size; if it sums them, do not.

Where this departs from references:
- seq_mean_token_sum_norm divides by B * L_max (Dr. GRPO, TRL); verl divides by L_max only.
- Fully masked rows count in B (Dr. GRPO's batch size) but not in B' (verl excludes them).
- Groups with no valid token do not count in P.
Whether M is the mask before or after rejection sampling is the caller's choice (a recipe flag).
"""

from __future__ import annotations

import torch

from asyncrl.algo._masked import as_mask, dense_groups, fp32
from asyncrl.algo.registry import REDUCTIONS

__all__ = ["aggregate", "global_reduction_stats", "reduction_stats", "reduction_weights", "weighted_sum"]

# Layout of the statistics vector: three scalar counts, then one token count per group.
_TOKENS, _NONEMPTY_SEQS, _SEQS, _GROUPS = 0, 1, 2, 3


def _check_mode(mode: str) -> None:
    if mode not in REDUCTIONS:
        raise ValueError(f"unknown reduction {mode!r}; valid: {', '.join(REDUCTIONS)}")


def reduction_stats(
    mask: torch.Tensor, group_ids: torch.Tensor | None = None, num_groups: int | None = None
) -> torch.Tensor:
    """Local normaliser statistics of these rows, int64 [3 + num_groups].

    mask: [B, T]; group_ids: [B] dense global group ids in [0, num_groups) (needed for prompt_mean only).
    Layout: (valid tokens, non-empty sequences, sequences, valid tokens of group 0, 1, ...).
    Summing the vectors of disjoint row sets gives the statistics of their union.
    """
    mask = as_mask(mask)
    lengths = mask.sum(-1)
    head = torch.stack([lengths.sum(), (lengths > 0).sum(), torch.tensor(mask.shape[0], device=mask.device)])
    if group_ids is None or num_groups is None:
        return head.to(torch.int64)
    if group_ids.numel() and (int(group_ids.min()) < 0 or int(group_ids.max()) >= num_groups):
        raise ValueError(f"group_ids must be dense ids in [0, {num_groups}) when num_groups is given")
    per_group = torch.zeros(num_groups, dtype=torch.int64, device=mask.device)
    per_group.index_add_(0, group_ids.long(), lengths.long())
    return torch.cat([head.to(torch.int64), per_group])


def global_reduction_stats(
    mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    num_groups: int | None = None,
    process_group=None,
) -> torch.Tensor:
    """`reduction_stats` summed over all ranks of `process_group` (a no-op when torch.distributed is not
    initialised). Every rank must pass the same `num_groups`."""
    stats = reduction_stats(mask, group_ids, num_groups)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM, group=process_group)
    return stats


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x with 0 where x == 0: an empty denominator gives zero weights instead of inf/NaN."""
    x = x.to(torch.float64)
    return torch.where(x > 0, 1.0 / x.clamp(min=1), 0.0)


def reduction_weights(
    mode: str,
    mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    l_max: int | None = None,
    stats: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights [B, T] (`dtype`, default fp32; 0 at masked positions) such that the batch loss is
    `(per_token_loss * weights).sum()`.

    mask: [B, T] final loss mask. group_ids: [B] (prompt_mean only; arbitrary ids when `stats` is None,
    dense global ids otherwise). l_max: the fixed max response length (seq_mean_token_sum_norm only).
    stats: global statistics from `reduction_stats` summed over every micro-batch and rank; None means
    the rows given here are the whole optimizer batch. Computed in float64, returned in `dtype`.
    """
    _check_mode(mode)
    mask = as_mask(mask)
    if mode == "prompt_mean" and group_ids is None:
        raise ValueError("reduction 'prompt_mean' needs group_ids")
    if mode == "seq_mean_token_sum_norm" and (l_max is None or l_max <= 0):
        raise ValueError("reduction 'seq_mean_token_sum_norm' needs l_max > 0 (the fixed max response length)")
    if stats is None:
        if mode == "prompt_mean":
            assert group_ids is not None  # checked on entry
            group_ids, num_groups = dense_groups(group_ids)
            stats = reduction_stats(mask, group_ids, num_groups)
        else:
            stats = reduction_stats(mask)
    m = mask.to(torch.float64)
    lengths = m.sum(-1, keepdim=True)
    if mode == "token_mean":
        weights = m * _safe_reciprocal(stats[_TOKENS])
    elif mode == "seq_mean_token_mean":
        weights = m * _safe_reciprocal(lengths) * _safe_reciprocal(stats[_NONEMPTY_SEQS])
    elif mode == "seq_mean_token_sum":
        weights = m * _safe_reciprocal(stats[_NONEMPTY_SEQS])
    elif mode == "seq_mean_token_sum_norm":
        assert l_max is not None  # checked on entry
        weights = m * _safe_reciprocal(stats[_SEQS] * l_max)
    else:  # prompt_mean
        group_tokens = stats[_GROUPS:]
        if group_tokens.numel() == 0:
            raise ValueError("reduction 'prompt_mean' needs stats with per-group token counts (pass num_groups)")
        num_prompts = (group_tokens > 0).sum()
        assert group_ids is not None  # checked on entry
        per_row = _safe_reciprocal(group_tokens[group_ids.long()]) * _safe_reciprocal(num_prompts)
        weights = m * per_row[:, None]
    return weights.to(dtype)


def weighted_sum(per_token_loss: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """`sum(per_token_loss * token_weights)` over entries with non-zero weight.

    Entries with zero weight are selected away before the product so a non-finite value there cannot
    poison the sum. With all weights zero (empty mask) the result is 0 but still connected to the graph
    of `per_token_loss`, so backward() works and gives zero gradients (the `0 * sum(logp)` guard).
    """
    loss = fp32(per_token_loss)
    w = token_weights.to(loss.dtype)
    keep = w != 0
    return (torch.where(keep, loss, 0.0) * w).sum()


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    group_ids: torch.Tensor | None = None,
    l_max: int | None = None,
) -> torch.Tensor:
    """Whole-batch reduction: `weighted_sum(per_token_loss, reduction_weights(mode, mask, ...))`.

    Only exact when `per_token_loss` holds the whole optimizer batch; micro-batched training must compute
    `reduction_weights` once over the batch and slice it.
    """
    dtype = fp32(per_token_loss).dtype
    return weighted_sum(per_token_loss, reduction_weights(mode, mask, group_ids, l_max, dtype=dtype))
