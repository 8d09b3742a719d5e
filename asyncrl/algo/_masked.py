"""Masked-tensor helpers shared by the algo modules (private).

Padding and masked positions of log-prob tensors may hold -inf or NaN. Every public function
selects valid entries with `torch.where` *before* any arithmetic: multiplying by a 0/1 mask
afterwards would turn `0 * inf` into NaN in the value and `0 * NaN` into NaN in the gradient.
"""

from __future__ import annotations

import torch

# Log-ratios are clamped before exp so that a single bad token cannot overflow fp32 (verl uses +-20).
LOG_RATIO_BOUND = 20.0


def fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision inputs; float64 stays float64 (reference tests use it)."""
    return x if x.dtype == torch.float64 else x.float()


def as_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def valid(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`x` in at least fp32 with masked entries replaced by `fill` (gradient 0 there)."""
    x = fp32(x)
    return torch.where(mask, x, fill)


def log_difference(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact `numerator - denominator` of log-probs, 0 at masked positions; gradient flows to both.

    For quantities that are polynomial in the difference (k1, k2): they stay finite at any ratio."""
    return valid(numerator, mask) - valid(denominator, mask)


def log_ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`log_difference` clamped to +-LOG_RATIO_BOUND, for callers that exponentiate it. The clamp zeroes
    the gradient beyond the bound, so never use it where the difference itself is the quantity."""
    return log_difference(numerator, denominator, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    x = valid(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries; an all-masked slice gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def seq_lengths(mask: torch.Tensor) -> torch.Tensor:
    """`|y_i|`: valid tokens per row, as float. mask: [B, T] -> [B]."""
    return mask.sum(-1).float()


def dense_groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Arbitrary integer group ids [N] -> (dense index in [0, G) [N], G)."""
    uniq, dense = torch.unique(group_ids, return_inverse=True)
    return dense, int(uniq.numel())


def group_sum(x: torch.Tensor, dense: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sum of x [N] -> [G]."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, dense, x)
