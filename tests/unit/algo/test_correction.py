"""Mismatch corrections of docs/algorithms.md#corrections on F-POL, composed with PPO (eps 0.2, dual clip c = 3)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import correction as C
from asyncrl.algo import losses
from asyncrl.algo.recipes import compute_policy_loss, compute_token_weights, resolve_recipe
from asyncrl.algo.reduction import reduction_weights, weighted_sum

from .helpers import close, t


def kappa_log(pol):
    return C.detached_log_ratio(pol.old, pol.rollout, pol.mask)


def ppo_dual(pol):
    per_token, _ = losses.ppo_clip(pol.logp, pol.old, pol.adv, pol.mask, 0.2, 0.2, dual_clip_c=3.0)
    return per_token


def corrected_loss(pol, weight, keep=None, denominator_mask=None):
    per_token = ppo_dual(pol) * weight
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    mask = pol.mask if denominator_mask is None else denominator_mask
    return weighted_sum(per_token, reduction_weights("token_mean", mask))


# ---------------------------------------------------------------- 5.1 TIS


def test_token_tis_matches_spec(fpol):
    w = C.truncated_is_weights(kappa_log(fpol), fpol.mask, cap=2.0)
    close(w, t([[1.051271, 0.472367, 1, 2], [1.349859, 0.980199, 2, 0], [0.904837, 1.822119, 1, 0.506617]]))
    loss = corrected_loss(fpol, w)
    close(loss, 0.460952)
    close(
        fpol.grad(loss),
        t([[-0.105621, 0, -0.060938, -0.185491], [0, 0.057209, 0.095570, 0], [0, 0.189082, 0.133244, 0]]),
    )
    assert not w.requires_grad


def test_sequence_tis_matches_spec(fpol):
    # fp32 spacing near 8 is 1e-6, hence the looser tolerance.
    close(C.is_weights(kappa_log(fpol), fpol.mask, "sequence")[:, 0], [1.221403, 8.004469, 0.835270], atol=3e-6)
    w = C.truncated_is_weights(kappa_log(fpol), fpol.mask, cap=2.0, level="sequence")
    close(w[:, 0], [1.221403, 2.0, 0.835270])
    loss = corrected_loss(fpol, w)
    close(loss, 0.385587)
    close(
        fpol.grad(loss),
        t([[-0.122714, 0, -0.074430, -0.113280], [0, 0.116730, 0.095570, 0], [0, 0.086676, 0.111295, 0]]),
    )


def test_tis_batch_normalisation_divides_by_the_mean_after_truncation(fpol):
    w = C.truncated_is_weights(kappa_log(fpol), fpol.mask, cap=2.0, batch_normalize=True)
    close(w[fpol.mask].mean(), 1.0)


# ---------------------------------------------------------------- 5.2 MIS / rejection sampling


def test_token_mis_keeps_untruncated_weights_inside_the_interval(fpol):
    w, keep = C.masked_is(kappa_log(fpol), fpol.mask, upper=2.0, lower=0.5)
    assert keep.tolist() == [[True, False, True, False], [True, True, False, False], [True, True, True, True]]
    close(w[0, 0], 1.051271)
    # Denominator over the 8 KEPT tokens (verl's convention).
    close(corrected_loss(fpol, w, keep, denominator_mask=fpol.mask & keep), 0.828305)


def test_sequence_and_geometric_mis_and_rollout_rs_match_spec(fpol):
    lk = kappa_log(fpol)
    _, keep = C.masked_is(lk, fpol.mask, 2.0, 0.5, level="sequence")
    assert keep.any(-1).tolist() == [True, False, True]
    assert C.rejection_keep(lk, fpol.mask, "seq_sum_k1", upper=2.0, lower=0.5).any(-1).tolist() == [True, False, True]
    close(C.is_weights(lk, fpol.mask, "geometric")[:, 0], [1.051271, 2.000372, 0.955997])
    assert not C.rejection_keep(lk, fpol.mask, "seq_mean_k1", upper=1.001, lower=0.999).any()  # Geo-RS keeps none


def test_rollout_rs_token_k1_uses_the_inverted_ratio():
    # kappa = pi_old / mu = 3: mu / pi_old = 1/3 is below lower = 0.5, so the token is rejected,
    # while kappa = 1/3 (mu / pi_old = 3 > upper) is rejected too, and kappa = 1.5 kept.
    lk = torch.log(torch.tensor([[3.0, 1 / 3, 1.5]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert C.rejection_keep(lk, mask, "token_k1", upper=2.0, lower=0.5).tolist() == [[False, False, True]]
    # k2 = 0.5 log(1.5)^2 = 0.0822; k3 = 1.5 - 1 - log 1.5 = 0.0945.
    assert C.rejection_keep(lk, mask, "token_k2", upper=0.09).tolist() == [[False, False, True]]
    assert C.rejection_keep(lk, mask, "token_k3", upper=0.09).tolist() == [[False, False, False]]
    assert C.rejection_keep(lk, mask, "seq_max_k2", upper=1.0).tolist() == [[True, True, True]]


def test_veto_rejects_the_whole_sequence_with_one_tiny_ratio(fpol):
    keep = C.veto_keep(kappa_log(fpol), fpol.mask, threshold=0.5)  # row 0 has kappa 0.472, row 2 min 0.507
    assert keep.any(-1).tolist() == [False, True, True]
    assert torch.equal(keep[1:], fpol.mask[1:])
    keep = C.veto_keep(kappa_log(fpol), fpol.mask, threshold=0.51)
    assert keep.any(-1).tolist() == [False, True, False]  # rows 0 (0.472) and 2 (0.507) vetoed


# ---------------------------------------------------------------- 5.3 IcePop, 5.4 decoupled


def test_icepop_matches_spec(fpol):
    w, keep = C.icepop(kappa_log(fpol), fpol.mask, 0.5, 5.0)
    close(w, t([[1.051271, 0, 1, 2.459603], [1.349859, 0.980199, 0, 0], [0.904837, 1.822119, 1, 0.506617]]))
    loss = corrected_loss(fpol, w, keep)  # denominator stays 11 (slime)
    close(loss, 0.374287)
    close(
        fpol.grad(loss),
        t([[-0.105621, 0, -0.060938, -0.228117], [0, 0.057209, 0, 0], [0, 0.189082, 0.133244, 0]]),
    )
    close((fpol.mask & ~keep).sum() / fpol.mask.sum(), 0.181818)


def test_decoupled_ppo_masks_behaviour_weights_above_the_cap(fpol):
    w, keep = C.decoupled_weights(kappa_log(fpol), fpol.mask, cap=5.0)
    assert (fpol.mask & ~keep).nonzero().tolist() == [[1, 2]]  # kappa = 6.05
    close(corrected_loss(fpol, w, keep), 0.322756)


# ---------------------------------------------------------------- 5.5 bypass, 5.6 DIS, 5.7 OPSM (through recipes)


def recipe_loss(pol, reduction, **kwargs):
    recipe = resolve_recipe(None, advantage="grpo", reduction=reduction, **kwargs)
    weights = compute_token_weights(recipe, pol.mask, None, pol.old, pol.rollout)
    return compute_policy_loss(recipe, pol.logp, pol.old, pol.rollout, pol.adv, pol.mask, weights)


def test_bypass_ppo_uses_q_as_the_ratio_without_extra_weight(fpol):
    loss, _ = recipe_loss(fpol, "token_mean", loss="ppo", correction="bypass", dual_clip_c=3.0)
    close(loss, 0.639310)
    close(
        fpol.grad(loss),
        t([[-0.105621, -0.060938, -0.060938, 0], [0.045455, 0.057209, 0, 0], [0, 0.189082, 0.133244, 0]]),
    )


def test_bypass_reinforce_weights_by_truncated_q(fpol):
    loss, _ = recipe_loss(fpol, "seq_mean_token_sum", loss="reinforce", correction="bypass", tis_cap=2.0)
    close(loss, -0.937644)
    # g = -A min(q, 2) / B, e.g. [0,3]: -1 * 2 / 3.
    close(
        fpol.grad(loss),
        t([[-0.387278, -0.223440, -0.223440, -0.666667], [0.166667, 0.209767, 0.333333, 0],
           [0.8, 0.693301, 0.488561, 0.111215]]),
    )


def test_dis_gates_q_on_both_sides_with_a_reinforce_surrogate(fpol):
    log_q = C.detached_log_ratio(fpol.logp, fpol.rollout, fpol.mask)
    _, keep = C.dis_gate(log_q, fpol.mask, 0.3, 5.0)
    assert keep.tolist() == [[True, False, False, True], [True, True, False, False], [True, True, True, False]]
    loss, metrics = recipe_loss(fpol, "token_mean", loss="reinforce", correction="dis")
    close(loss, -0.419983)
    close(
        fpol.grad(loss),
        t([[-0.105621, 0, 0, -0.228117], [0.045455, 0.057209, 0, 0], [0.362195, 0.189082, 0.133244, 0]]),
    )
    close(metrics["correction_masked_fraction"], 4 / 11, atol=1e-6)


def test_dis_weight_is_detached_so_the_gradient_is_minus_q_times_a():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    recipe = resolve_recipe("sao")
    loss, _ = compute_policy_loss(recipe, logp, rollout, rollout, torch.ones(1, 1), mask, torch.ones(1, 1))
    (g,) = torch.autograd.grad(loss, logp)
    close(g, [[-math.exp(0.5)]])


def test_opsm_drops_only_negative_advantage_sequences_that_drifted(fpol):
    keep = C.opsm_keep(fpol.logp, fpol.rollout, fpol.adv, fpol.mask, delta=0.5)
    assert keep.tolist() == fpol.mask.tolist()  # row means [-0.0675, -0.693333, -0.1675]
    # Shift row 2 (A = -1.2) so that mean(rollout - logp) = -0.1675 + 1 > 0.5: dropped; row 0 has A > 0.
    logp = fpol.logp.detach().clone()
    logp[2] -= 1.0
    logp[0] -= 1.0
    keep = C.opsm_keep(logp, fpol.rollout, fpol.adv, fpol.mask, delta=0.5)
    assert keep.any(-1).tolist() == [True, True, False]


# ---------------------------------------------------------------- generic gate


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000), st.sampled_from(["mask", "truncate"]))
def test_gate_with_infinite_bounds_is_the_ungated_estimator(batch, length, seed, mode):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    ratio = torch.exp(torch.randn(batch, length, generator=gen) * 3)
    weight, keep = C.ratio_gate(ratio, mask, -math.inf, math.inf, mode)
    assert torch.equal(keep, mask)
    assert torch.equal(weight, torch.where(mask, ratio, torch.zeros_like(ratio)))
    # And a DIS recipe with infinite bounds equals REINFORCE weighted by the plain IS ratio q.
    logp = torch.randn(batch, length, generator=gen).requires_grad_(True)
    rollout = torch.randn(batch, length, generator=gen)
    adv = torch.randn(batch, length, generator=gen)
    weights = reduction_weights("token_mean", mask)
    recipe = resolve_recipe("sao", dis_eps_low=1.0, dis_eps_high=1e30)
    gated, _ = compute_policy_loss(recipe, logp, rollout, rollout, adv, mask, weights)
    q = torch.exp(logp.detach() - rollout)
    plain = weighted_sum(losses.reinforce(logp, adv, mask)[0] * q, weights)
    (g1,) = torch.autograd.grad(gated, logp)
    (g2,) = torch.autograd.grad(plain, logp)
    close(gated, plain.item(), atol=1e-5)
    close(g1, g2, atol=1e-6)


def test_dis_bounds_are_strict_while_icepop_bounds_are_inclusive():
    mask = torch.ones(1, 3, dtype=torch.bool)
    log_r = torch.log(torch.tensor([[0.5, 6.0, 1.0]]))  # exp(log(.)) is exact for these in fp32
    _, dis_keep = C.dis_gate(log_r, mask, eps_low=0.5, eps_high=5.0)
    assert dis_keep.tolist() == [[False, False, True]]
    _, ice_keep = C.icepop(log_r, mask, alpha=0.5, beta=6.0)
    assert ice_keep.tolist() == [[True, True, True]]


def test_truncate_mode_clamps_instead_of_dropping():
    weight, keep = C.ratio_gate(torch.tensor([[0.1, 1.0, 9.0]]), torch.ones(1, 3, dtype=torch.bool), 0.5, 2.0, "truncate")
    assert keep.all()
    close(weight, [[0.5, 1.0, 2.0]])
