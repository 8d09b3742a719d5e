"""KL estimators of spec 2.8: values, gradients, clamps, KL-in-reward."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.kl import kl_in_reward, kl_penalty
from asyncrl.algo.reduction import aggregate

from .helpers import close

LOGP = [-1.0, -0.5, -2.0]
REF = torch.tensor([[-1.2, -0.5, -1.0]])
MASK = torch.ones(1, 3, dtype=torch.bool)


def logp():
    return torch.tensor([LOGP], requires_grad=True)


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        ("k1", [0.2, 0.0, -1.0], [1.0, 1.0, 1.0]),
        ("k2", [0.02, 0.0, 0.5], [0.2, 0.0, -1.0]),
        ("k3", [0.018731, 0.0, 0.718282], [0.181269, 0.0, -1.718282]),  # 1 - exp(ref - logp)
        ("k3_plus", [0.018731, 0.0, 0.718282], [0.2, 0.0, -1.0]),  # value of k3, gradient of k2
    ],
)
def test_kl_estimators_match_spec_values_and_gradients(estimator, value, grad):
    x = logp()
    kl = kl_penalty(x, REF, MASK, estimator)
    close(kl.detach(), [value])
    (g,) = torch.autograd.grad(kl.sum(), x)
    close(g, [grad])


def test_k3_token_mean_loss_with_coefficient():
    close(0.001 * aggregate(kl_penalty(logp(), REF, MASK, "k3"), MASK, "token_mean"), 0.000245671, atol=1e-9)


def test_k3_is_clamped_and_its_gradient_stays_finite_for_extreme_ratios():
    x = torch.tensor([[-80.0, 0.0]], requires_grad=True)
    kl = kl_penalty(x, torch.tensor([[0.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool), "k3")
    assert kl[0, 0].item() == 10.0
    (g,) = torch.autograd.grad(kl.sum(), x)
    assert torch.isfinite(g).all()


def test_kl_in_reward_subtracts_beta_k1_of_the_old_policy():
    out = kl_in_reward(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([LOGP]), REF, MASK, beta=0.05)
    close(out, [[-0.01, 0.0, 1.05]])


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="valid: k1, k2, k3, k3_plus"):
        kl_penalty(logp(), REF, MASK, "k4")
