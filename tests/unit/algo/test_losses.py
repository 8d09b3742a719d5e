"""Surrogates of docs/algorithms.md#losses on the F-POL fixture: loss values, per-token gradients, detach rules."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import losses
from asyncrl.algo.reduction import aggregate

from .helpers import close, make_fpol, t

N = 11  # valid tokens of F-POL


def token_mean(per_token, pol):
    return aggregate(per_token, pol.mask, "token_mean")


def seq_mean(per_token, pol):
    return aggregate(per_token, pol.mask, "seq_mean_token_mean")


# ---------------------------------------------------------------- PPO (2.1) and DAPO (2.2)

PPO_GRAD = [
    [-0.100470, 0, -0.060938, -0.092746],
    [0, 0.058365, 0.047785, 0],
    [0.400287, 0.103770, 0.133244, 0],
]


def test_ppo_without_dual_clip_matches_spec_loss_and_gradient(fpol):
    per_token, metrics = losses.ppo_clip(fpol.logp, fpol.old, fpol.adv, fpol.mask, 0.2, 0.2)
    loss = token_mean(per_token, fpol)
    close(loss, 0.503843)
    close(seq_mean(per_token, fpol), 0.505402)
    # Unclipped tokens: g = -A rho / N, e.g. [0,0]: -1 * 1.105171 / 11 = -0.100470; [0,1] rho=1.419 > 1.2 clipped.
    close(fpol.grad(loss), t(PPO_GRAD))
    # Clipped where l2 > l1: [0,1] (A>0, rho>1.2), [1,0] (A<0, rho<0.8), [2,3] (A<0, rho<0.8): 3/11.
    close(metrics["clipfrac"], 3 / 11)
    close(metrics["clipfrac_lower"], 0.0)


def test_ppo_dual_clip_caps_negative_advantage_tokens_and_zeroes_their_gradient(fpol):
    per_token, metrics = losses.ppo_clip(fpol.logp, fpol.old, fpol.adv, fpol.mask, 0.2, 0.2, dual_clip_c=3.0)
    close(
        per_token.detach(),
        t([[-1.105171, -1.2, -0.670320, -1.020201], [0.4, 0.642013, 0.525636, 0], [3.6, 1.141475, 1.465683, 0.96]]),
    )
    loss = token_mean(per_token, fpol)
    close(loss, 0.430829)
    expected = t(PPO_GRAD)
    expected[2, 0] = 0.0  # rho = 3.669 > c = 3 with A = -1.2: the loss is capped at 3 * 1.2 = 3.6
    close(fpol.grad(loss), expected)
    close(metrics["clipfrac_lower"], 1 / 11)

    per_token, _ = losses.ppo_clip(fpol.logp, fpol.old, fpol.adv, fpol.mask, 0.2, 0.2, dual_clip_c=3.0)
    loss = seq_mean(per_token, fpol)
    close(loss, 0.438472)
    close(
        fpol.grad(loss),
        t([[-0.092098, 0, -0.055860, -0.085017], [0, 0.071335, 0.058404, 0], [0, 0.095123, 0.122140, 0]]),
    )


def test_dapo_clip_higher_only_changes_the_cap_of_the_positive_side(fpol):
    per_token, _ = losses.ppo_clip(fpol.logp, fpol.old, fpol.adv, fpol.mask, 0.2, 0.28, dual_clip_c=3.0)
    loss = token_mean(per_token, fpol)
    close(loss, 0.423556)
    expected = t(PPO_GRAD)
    expected[2, 0] = 0.0
    close(fpol.grad(loss), expected)  # [0,1]: rho = 1.419 still above 1.28, gradient still 0
    per_token, _ = losses.ppo_clip(fpol.logp, fpol.old, fpol.adv, fpol.mask, 0.2, 0.28)
    close(token_mean(per_token, fpol), 0.496570)


def test_ppo_tokens_with_zero_advantage_have_zero_loss_and_gradient(fpol):
    adv = fpol.adv.clone()
    adv[0] = 0.0
    per_token, _ = losses.ppo_clip(fpol.logp, fpol.old, adv, fpol.mask, dual_clip_c=3.0)
    grad = fpol.grad(token_mean(per_token, fpol))
    assert torch.equal(per_token[0].detach(), torch.zeros(4))
    assert torch.equal(grad[0], torch.zeros(4))


# ---------------------------------------------------------------- CISPO (2.3)


def test_cispo_band_convention_gradient_is_minus_w_a_over_n_on_every_token(fpol):
    per_token, metrics = losses.cispo(fpol.logp, fpol.old, fpol.adv, fpol.mask, eps_low=0.2, eps_high=0.28)
    loss = token_mean(per_token, fpol)
    close(loss, -0.186668)  # only meaningful through its gradient
    # w = clip(rho, 0.8, 1.28); e.g. [0,1]: -1.28 * 1 / 11 = -0.116364 (PPO would give 0 there).
    close(
        fpol.grad(loss),
        t([[-0.100470, -0.116364, -0.072727, -0.092746], [0.036364, 0.058182, 0.047785, 0],
           [0.139636, 0.103770, 0.133244, 0.087273]]),
    )
    close(metrics["clipfrac"], 6 / 11)


def test_cispo_without_lower_bound_only_caps_from_above(fpol):
    per_token, _ = losses.cispo(fpol.logp, fpol.old, fpol.adv, fpol.mask, eps_low=None, eps_high=0.28)
    close(
        fpol.grad(token_mean(per_token, fpol)),
        t([[-0.100470, -0.116364, -0.060938, -0.092746], [0.033674, 0.058182, 0.047785, 0],
           [0.139636, 0.103770, 0.133244, 0.059870]]),
    )


def test_cispo_scalerl_absolute_cap(fpol):
    per_token, _ = losses.cispo(fpol.logp, fpol.old, fpol.adv, fpol.mask, eps_max=5.0)
    close(
        fpol.grad(token_mean(per_token, fpol)),
        t([[-0.100470, -0.129006, -0.060938, -0.092746], [0.033674, 0.058365, 0.047785, 0],
           [0.400287, 0.103770, 0.133244, 0.059870]]),
    )


def test_cispo_gradient_does_not_flow_through_the_is_weight():
    # One token, A = 1, rho = e^0.5 > cap: through-w gradient would be -w*A*logp*dw/dlogp != 0 extra.
    logp = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.5]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    per_token, _ = losses.cispo(logp, old, torch.ones(1, 1), mask, eps_low=0.2, eps_high=10.0)
    (g,) = torch.autograd.grad(per_token.sum(), logp)
    close(g, [[-torch.exp(torch.tensor(0.5)).item()]])  # exactly -w * A with w = rho


# ---------------------------------------------------------------- GSPO (2.4)


def fgspo():
    pol = make_fpol(dtype=torch.float64)
    delta = t([[2e-4, 1e-4, 3e-4, 2e-4], [6e-4, 5e-4, 7e-4, 0], [-5e-4, -6e-4, -4e-4, -5e-4]], torch.float64)
    logp = (pol.old + delta).requires_grad_(True)
    return logp, pol.old, pol.adv, pol.mask


def test_gspo_sequence_ratio_clipping_matches_spec():
    logp, old, adv, mask = fgspo()
    per_token, metrics = losses.gspo(logp, old, adv, mask)
    loss = aggregate(per_token, mask, "seq_mean_token_mean")
    close(loss, 0.233246690, atol=1e-9)
    (g,) = torch.autograd.grad(loss, logp)
    # seq 0 unclipped: -1 * 1.0002 / 4 / 3; seq 1 (A<0, s > 1+4e-4) unclipped: 0.5 * 1.0006 / 3 / 3; seq 2 clipped.
    close(g, t([[-0.083350] * 4, [0.055589] * 3 + [0], [0.0] * 4]))
    close(metrics["clipfrac"], 1 / 3)


def test_gspo_token_equals_gspo_in_value_and_gradient_with_shared_advantages():
    logp, old, adv, mask = fgspo()
    seq_loss = aggregate(losses.gspo(logp, old, adv, mask)[0], mask, "seq_mean_token_mean")
    tok_loss = aggregate(losses.gspo_token(logp, old, adv, mask)[0], mask, "seq_mean_token_mean")
    (g_seq,) = torch.autograd.grad(seq_loss, logp)
    (g_tok,) = torch.autograd.grad(tok_loss, logp)
    close(tok_loss, seq_loss.item(), atol=1e-12)
    close(g_tok, g_seq, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_gspo_token_equals_gspo_on_random_batches(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    logp = (old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length)
    a = aggregate(losses.gspo(logp, old, adv, mask, 0.1, 0.2)[0], mask, "seq_mean_token_mean")
    b = aggregate(losses.gspo_token(logp, old, adv, mask, 0.1, 0.2)[0], mask, "seq_mean_token_mean")
    (ga,) = torch.autograd.grad(a, logp)
    (gb,) = torch.autograd.grad(b, logp)
    close(a, b.item(), atol=1e-10)
    close(ga, gb, atol=1e-10)


def test_gspo_token_gradient_is_the_sequence_ratio_at_each_token():
    # d s_it / d logp_t = s_i (not s_i/|y_i|): with one unclipped sequence, A = 1, sum over tokens.
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.1]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    per_token, _ = losses.gspo_token(logp, old, torch.ones(1, 2, dtype=torch.float64), mask, 1.0, 1.0)
    (g,) = torch.autograd.grad(per_token.sum(), logp)
    s = torch.exp(torch.tensor(0.1, dtype=torch.float64))
    close(g, [[-s, -s]], atol=1e-12)


def test_gspo_empty_sequence_contributes_nothing_and_is_excluded_from_the_mean():
    logp, old, adv, mask = fgspo()
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    logp = torch.cat([logp.detach(), torch.full((1, 4), float("-inf"), dtype=torch.float64)]).requires_grad_(True)
    old = torch.cat([old, torch.full((1, 4), float("nan"), dtype=torch.float64)])
    adv = torch.cat([adv, torch.zeros(1, 4, dtype=torch.float64)])
    per_token, _ = losses.gspo(logp, old, adv, mask)
    loss = aggregate(per_token, mask, "seq_mean_token_mean")
    close(loss, 0.233246690, atol=1e-9)  # B' stays 3
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.equal(g[3], torch.zeros(4, dtype=torch.float64))


# ---------------------------------------------------------------- SAPO (2.5)


def test_sapo_gate_and_gradient_weight_match_spec(fpol):
    per_token, metrics = losses.sapo(fpol.logp, fpol.old, fpol.adv, fpol.mask)
    gate = t([[2.105074, 2.413040, 1.673274, 2.020201], [1.647168, 2.186701, 1.956021, 0],
              [3.591714, 1.856002, 2.125173, 1.461827]])
    close(per_token.detach(), -gate * fpol.adv)
    loss = seq_mean(per_token, fpol)
    close(loss, 0.540833)
    # g = -A w / (|y_i| B), w = 4 s (1-s) rho; e.g. [1,0]: 0.5 * 0.727269 / 3 / 3 = 0.040404.
    close(
        fpol.grad(loss),
        t([[-0.091843, -0.113212, -0.054369, -0.085008], [0.040404, 0.069772, 0.058362, 0],
           [0.079119, 0.095061, 0.120505, 0.051913]]),
    )


def test_sapo_gradient_weight_is_exactly_one_at_ratio_one():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -3.0]])  # both temperatures
    per_token, _ = losses.sapo(logp, logp.detach(), adv, torch.ones(1, 2, dtype=torch.bool), 1.0, 1.05)
    (g,) = torch.autograd.grad(per_token.sum(), logp)
    close(g, [[-2.0, 3.0]])


# ---------------------------------------------------------------- DPPO (2.6)


def test_dppo_binary_tv_masks_only_risky_moves_and_weights_by_capped_q(fpol):
    p_minus_mu = torch.exp(fpol.logp.detach()) - torch.exp(fpol.rollout)
    close(
        torch.where(fpol.mask, p_minus_mu, torch.zeros(3, 4)),
        t([[0.056632, -0.313601, -0.073562, 0.411330], [0.0, 0.107263, 0.656344, 0],
           [0.347017, 0.220852, 0.073699, -0.707667]]),
    )
    per_token, metrics = losses.dppo(fpol.logp, fpol.rollout, fpol.adv, fpol.mask, "binary_tv", clip_c=20.0)
    # Invalid: [0,3] (A>0, p rose by 0.41 > 0.15) and [2,3] (A<0, p fell by 0.71); [1,2] rose with A<0: kept.
    close(metrics["masked_fraction"], 2 / 11)
    close(
        fpol.grad(token_mean(per_token, fpol)),
        t([[-0.105621, -0.060938, -0.060938, 0], [0.045455, 0.057209, 0.289083, 0],
           [0.362195, 0.189082, 0.133244, 0]]),
    )


def test_dppo_binary_kl_divergence_and_mask_match_spec(fpol):
    d = losses.binary_kl(fpol.logp.detach(), fpol.rollout)
    close(
        torch.where(fpol.mask, d, torch.zeros(3, 4)),
        t([[0.006761, 0.282680, 0.018968, 0.355535], [0.0, 0.023088, 0.982766, 0],
           [0.266424, 0.099790, 0.011522, 1.183294]]),
    )
    per_token, metrics = losses.dppo(fpol.logp, fpol.rollout, fpol.adv, fpol.mask, "binary_kl")
    close(metrics["masked_fraction"], 2 / 11)  # same mask as TV here
    close(
        fpol.grad(token_mean(per_token, fpol)),
        t([[-0.105621, -0.060938, -0.060938, 0], [0.045455, 0.057209, 0.289083, 0],
           [0.362195, 0.189082, 0.133244, 0]]),
    )


def test_dppo_topk_divergences_match_the_toy_distribution():
    mu = torch.tensor([0.5, 0.3])  # top-2 of [.5, .3, .1, .06, .04]
    p = torch.tensor([0.4, 0.35])  # current policy on the same ids, full [.4, .35, .12, .08, .05]
    close(losses.topk_tv(mu, p), 0.1)  # 0.5 * (0.1 + 0.05 + |0.2 - 0.25|)
    close(losses.topk_kl(mu, p), 0.020698)  # .5 ln(.5/.4) + .3 ln(.3/.35) + .2 ln(.2/.25)


def test_dppo_accepts_a_precomputed_divergence(fpol):
    divergence = torch.zeros(3, 4)
    per_token, metrics = losses.dppo(fpol.logp, fpol.rollout, fpol.adv, fpol.mask, divergence, 0.1, 0.1)
    assert metrics["masked_fraction"].item() == 0.0
    assert torch.isfinite(per_token).all()


# ---------------------------------------------------------------- GVPO (2.7)


def test_gvpo_matches_spec_loss_and_gradient(fpol):
    rewards = torch.tensor([1.0, 0.0, 0.5])
    adv = rewards - rewards.mean()  # Dr.GRPO advantages [0.5, -0.5, 0]
    per_token, metrics = losses.gvpo(fpol.logp, fpol.old, adv, fpol.mask, torch.zeros(3, dtype=torch.long), beta=0.1)
    # R_theta = [0.007, 0, 0.085]; residual = [-0.523667, 0.469333, 0.054333]; L = sum 0.5 res^2 / (k-1).
    loss = per_token.sum()  # the official sum over groups
    close(loss, 0.124363)
    close(fpol.grad(loss), t([[-0.026183] * 4, [0.023467] * 3 + [0], [0.002717] * 4]))  # beta res_i / (k-1)
    close(metrics["residual_abs_mean"], (0.523667 + 0.469333 + 0.054333) / 3, atol=2e-6)


def test_gvpo_singleton_groups_contribute_nothing(fpol):
    per_token, _ = losses.gvpo(fpol.logp, fpol.old, fpol.adv, fpol.mask, torch.tensor([0, 1, 2]))
    assert torch.equal(per_token.detach(), torch.zeros(3, 4))


# ---------------------------------------------------------------- REINFORCE and cross-checks


def test_reinforce_gradient_is_minus_advantage(fpol):
    per_token, _ = losses.reinforce(fpol.logp, fpol.adv, fpol.mask)
    close(fpol.grad(per_token.sum()), -fpol.adv)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000), st.sampled_from([None, 3.0]))
def test_ppo_with_ratio_one_has_the_reinforce_gradient(batch, length, seed, dual_clip):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.8
    logp = (-torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    ppo, _ = losses.ppo_clip(logp, logp.detach(), adv, mask, 0.2, 0.28, dual_clip)
    pg, _ = losses.reinforce(logp, adv, mask)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    (g_pg,) = torch.autograd.grad(pg.sum(), logp)
    close(g_ppo, g_pg, atol=1e-12)
    close(ppo.sum(), -torch.where(mask, adv, torch.zeros_like(adv)).sum().item(), atol=1e-9)  # value -A * 1


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_cispo_equals_ppo_in_gradient_inside_the_clip_band(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.8
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    # |log rho| < 0.15 keeps rho inside [0.8, 1.2] for every token.
    logp = (old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 0.3).requires_grad_(True)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    ppo, _ = losses.ppo_clip(logp, old, adv, mask, 0.2, 0.2)
    cis, _ = losses.cispo(logp, old, adv, mask, 0.2, 0.2)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    (g_cis,) = torch.autograd.grad(cis.sum(), logp)
    close(g_cis, g_ppo, atol=1e-12)


# ---------------------------------------------------------------- value loss


def test_value_loss_is_half_squared_error_and_clips_around_old_values():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 2.5, 0.0]])
    old = torch.tensor([[0.5, 2.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    per_token, _ = losses.value_loss(values, returns, mask)
    close(per_token.detach(), [[0.5, 0.125, 0.0]])
    # clip 0.2: v_clipped = [0.7, 2.0]; (0.7-0)^2/2 = 0.245 < 0.5 -> keep 0.5; (2.0-2.5)^2/2 = 0.125 equal.
    per_token, metrics = losses.value_loss(values, returns, mask, old, clip=0.2)
    close(per_token.detach(), [[0.5, 0.125, 0.0]])
    (g,) = torch.autograd.grad(per_token.sum(), values)
    close(g, [[1.0, -0.5, 0.0]])
