"""KL estimators of docs/algorithms.md#kl-penalties: values, gradients, clamps, KL-in-reward."""

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


# d = logp - ref at +-30 and +-50 (beyond the +-20 bound of the exponentiated log-ratios), and d = 10,
# where k3 = exp(-10) + 9 = 9.0000454 is still below its value bound 10.
FAR_LOGP = [-1.0, -31.0, -1.0, -51.0, -1.0]
FAR_REF = torch.tensor([[-31.0, -1.0, -51.0, -1.0, -11.0]])
FAR_MASK = torch.ones(1, 5, dtype=torch.bool)


def closed_form(estimator, d):
    """The estimators written out on the exact d, in float64 (no guard needed there for |d| <= 50)."""
    k2 = 0.5 * d**2
    k3 = (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    return {"k1": d, "k2": k2, "k3": k3, "k3_plus": k3.detach() + (k2 - k2.detach())}[estimator]


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # k1 = d; gradient 1 everywhere.
        ("k1", [30.0, -30.0, 50.0, -50.0, 10.0], [1.0] * 5),
        # k2 = 0.5 d^2: 0.5*900 = 450, 0.5*2500 = 1250, 0.5*100 = 50; gradient d.
        ("k2", [450.0, 450.0, 1250.0, 1250.0, 50.0], [30.0, -30.0, 50.0, -50.0, 10.0]),
        # k3: exp(-30) + 29 = 29 > 10, exp(30) - 31 = 1.07e13 > 10, ... -> clamped to 10, gradient 0;
        # d = 10: exp(-10) + 9 = 9.0000454, gradient 1 - exp(-10) = 0.9999546.
        ("k3", [10.0, 10.0, 10.0, 10.0, 9.0000454], [0.0, 0.0, 0.0, 0.0, 0.9999546]),
        # k3_plus: the k3 values above, the k2 gradient d.
        ("k3_plus", [10.0, 10.0, 10.0, 10.0, 9.0000454], [30.0, -30.0, 50.0, -50.0, 10.0]),
    ],
)
def test_kl_estimators_are_exact_far_beyond_the_exp_guard(estimator, value, grad):
    x = torch.tensor([FAR_LOGP], requires_grad=True)
    kl = kl_penalty(x, FAR_REF, FAR_MASK, estimator)
    close(kl.detach(), [value], atol=1e-4)
    (g,) = torch.autograd.grad(kl.sum(), x)
    close(g, [grad], atol=1e-5)
    x64 = torch.tensor([FAR_LOGP], dtype=torch.float64, requires_grad=True)
    (g_ref,) = torch.autograd.grad(closed_form(estimator, x64 - FAR_REF.double()).sum(), x64)
    close(g, g_ref, atol=1e-5)


def test_kl_in_reward_is_exact_far_beyond_the_exp_guard():
    # k1 = old - ref = [30, -30, 50, -50, 10]; r - 0.1 * k1 with r = 0.
    out = kl_in_reward(torch.zeros(1, 5), torch.tensor([FAR_LOGP]), FAR_REF, FAR_MASK, beta=0.1)
    close(out, [[-3.0, 3.0, -5.0, 5.0, -1.0]], atol=1e-6)


def test_kl_in_reward_subtracts_beta_k1_of_the_old_policy():
    out = kl_in_reward(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([LOGP]), REF, MASK, beta=0.05)
    close(out, [[-0.01, 0.0, 1.05]])


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="valid: k1, k2, k3, k3_plus"):
        kl_penalty(logp(), REF, MASK, "k4")
