"""Shared fixtures F-POL (policy) and F-ADV (advantages); F-ADV is the worked example of docs/algorithms.md#advantages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAN, NEG_INF = float("nan"), -math.inf


@dataclass
class Pol:
    logp: torch.Tensor  # learner log-probs, requires grad
    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor  # bool [3, 4]
    adv: torch.Tensor  # per-token advantages [3, 4], broadcast per sequence
    adv_seq: torch.Tensor  # [3]

    def grad(self, loss: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(loss, self.logp)
        return g


def make_fpol(pad_logp: float = -1.0, pad_old: float = -1.0, pad_rollout: float = -1.0, dtype=torch.float32) -> Pol:
    """F-POL: 3 sequences x 4 tokens, row 1 has 3 valid tokens (N = 11). Pads get the given fill values."""
    old = [[-1.0, -0.8, -1.5, -0.4], [-1.2, -0.9, -0.3, pad_old], [-2.0, -0.6, -1.1, -0.7]]
    logp = [[-0.9, -0.45, -1.9, -0.38], [-1.5, -0.65, -0.25, pad_logp], [-0.7, -0.65, -0.9, -1.3]]
    rollout = [[-1.05, -0.05, -1.5, -1.3], [-1.5, -0.88, -2.1, pad_rollout], [-1.9, -1.2, -1.1, -0.02]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv_seq = torch.tensor([1.0, -0.5, -1.2], dtype=dtype)
    adv = torch.where(mask, adv_seq[:, None].expand(3, 4), torch.zeros(3, 4, dtype=dtype))
    return Pol(
        logp=torch.tensor(logp, dtype=dtype, requires_grad=True),
        old=torch.tensor(old, dtype=dtype),
        rollout=torch.tensor(rollout, dtype=dtype),
        mask=mask,
        adv=adv,
        adv_seq=adv_seq,
    )


def make_fadv() -> tuple[torch.Tensor, torch.Tensor]:
    """F-ADV: 3 prompts x G=3 -> (rewards [9], group_ids [9])."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.4])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    return rewards, group_ids


def t(rows, dtype=torch.float32) -> torch.Tensor:
    """Expected values; pad entries written as 0 (the spec's '-')."""
    return torch.tensor(rows, dtype=dtype)


def close(actual: torch.Tensor | float, expected, atol: float = 1e-6) -> None:
    actual_t = torch.as_tensor(actual, dtype=torch.float64).detach()
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert actual_t.shape == expected_t.shape, (actual_t.shape, expected_t.shape)
    assert torch.allclose(actual_t, expected_t, atol=atol, rtol=0), f"\nactual   {actual_t}\nexpected {expected_t}"
