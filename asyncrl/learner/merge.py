"""How the pieces of one learner step combine: metrics over micro-batches, ranks and updates, advantages
whitened with batch-global moments, and the record of one policy update (`step.RankStep` runs them).
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")

__all__ = [
    "Update",
    "apply_whitening",
    "mean_over_updates",
    "merge_metrics",
    "pad_cat",
    "regroup",
    "update_metrics",
    "whitening_moments",
]

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
    for adv, mask in zip(advantages, masks, strict=True):
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
    return [
        torch.where(m.bool(), (a - mean) * scale, torch.zeros_like(a)).float()
        for a, m in zip(advantages, masks, strict=True)
    ]


def pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


@dataclass(frozen=True)
class Update:
    """One policy update of a step. `loss`, `grad_norm`, `clipfrac` and `approx_kl` are global (every rank
    holds the same values); `metrics` are this rank's. `stopped`: approx-KL exceeded `learner.kl_stop`, so
    the gradients were discarded and the step ends here."""

    loss: float
    grad_norm: float
    stepped: bool
    clipfrac: float
    approx_kl: float
    metrics: dict[str, float]
    stopped: bool = False


def update_metrics(updates: Sequence[Update]) -> dict[str, float]:
    """Per-step report of several updates: `clipfrac_mb{i}`, `approx_kl_mb{i}`, `loss_mb{i}` per update i
    (epoch-major: i = epoch * mini_batches + k), `approx_kl` of the last one measured and `approx_kl_max`,
    `updates` (optimizer steps taken), `kl_stopped` (0/1) and `skipped_step` (1 if any update had a
    non-finite gradient norm)."""
    taken = [u for u in updates if not u.stopped]
    out = {
        "updates": float(sum(u.stepped for u in taken)),
        "kl_stopped": float(any(u.stopped for u in updates)),
        "skipped_step": float(any(not u.stepped for u in taken)),
    }
    for i, u in enumerate(updates):
        out.update({f"clipfrac_mb{i}": u.clipfrac, f"approx_kl_mb{i}": u.approx_kl, f"loss_mb{i}": u.loss})
    if updates:
        out.update(approx_kl=updates[-1].approx_kl, approx_kl_max=max(u.approx_kl for u in updates))
    return out


def mean_over_updates(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rank's metrics of several updates as one step's: every update is an equal optimizer step, so
    the plain mean over the updates that report a key; `*_max` / `*_min` take the extreme."""
    out: dict[str, float] = {}
    for key in sorted({k for metrics in parts for k in metrics}):
        values = [metrics[key] for metrics in parts if key in metrics]
        if key.endswith("_max"):
            out[key] = float(max(values))
        elif key.endswith("_min"):
            out[key] = float(min(values))
        else:
            out[key] = float(np.mean(values))
    return out


def regroup(flat: list[T], like: Sequence[Sized]) -> list[list[T]]:
    """`flat` cut into consecutive runs of the lengths of `like`'s items."""
    out: list[list[T]] = []
    start = 0
    for part in like:
        out.append(flat[start : start + len(part)])
        start += len(part)
    return out
