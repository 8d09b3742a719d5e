"""Advantage estimators of docs/algorithms.md#advantages: test vectors, edge cases, and a slow GAE reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import advantages as A

from .helpers import close

ONE_SEQ_MASK = torch.ones(1, 4, dtype=torch.bool)
VALUES = torch.tensor([[0.5, 0.6, 0.7, 0.8]])


def as_groups(rows):
    rewards = torch.tensor([r for row in rows for r in row])
    group_ids = torch.tensor([g for g, row in enumerate(rows) for _ in row])
    return rewards, group_ids


# ---------------------------------------------------------------- 1.1 REINFORCE


def test_reinforce_baseline_subtracts_the_baseline():
    close(A.reinforce_baseline(torch.tensor([1.0, 0.0, 0.5]), 0.4), [0.6, -0.4, 0.1])


# ---------------------------------------------------------------- 1.2 GAE


def test_gae_terminal_matches_spec():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    adv, ret = A.gae(rewards, VALUES, ONE_SEQ_MASK, gamma=1.0, lam=0.95)
    # Last token: delta = 1 + 0 - 0.8 = 0.2; previous: (0 + 0.8 - 0.7) + 0.95 * 0.2 = 0.29.
    close(adv, [[0.456725, 0.375500, 0.290000, 0.200000]])
    close(ret, [[0.956725, 0.975500, 0.990000, 1.000000]])
    adv, _ = A.gae(rewards, VALUES, ONE_SEQ_MASK, gamma=0.99, lam=0.95)
    close(adv, [[0.429226, 0.356434, 0.280100, 0.200000]])


def test_gae_with_lambda_one_is_the_monte_carlo_return_minus_value():
    adv, ret = A.gae(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), VALUES, ONE_SEQ_MASK, 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3, 0.2]])
    close(ret, [[1.0, 1.0, 1.0, 1.0]])


def test_gae_truncated_sequence_bootstraps_from_the_next_state_value():
    zeros = torch.zeros(1, 4)
    adv, _ = A.gae(zeros, VALUES, ONE_SEQ_MASK, 1.0, 0.95, torch.tensor([False]), torch.tensor([0.9]))
    # Last token: 0 + 0.9 - 0.8 = 0.1.
    close(adv, [[0.370987, 0.285250, 0.195000, 0.100000]])
    adv, _ = A.gae(zeros, VALUES, ONE_SEQ_MASK, 1.0, 0.95, torch.tensor([True]), torch.tensor([0.9]))
    close(adv, [[-0.400650, -0.527000, -0.660000, -0.800000]])  # treated as terminal: the wrong answer


def test_gae_refuses_truncated_sequences_without_bootstrap_values():
    try:
        A.gae(torch.zeros(1, 4), VALUES, ONE_SEQ_MASK, dones=torch.tensor([False]))
    except ValueError as err:
        assert "bootstrap_values" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_gae_carries_value_and_advantage_across_masked_observation_tokens():
    # An observation token (mask 0, value NaN) between two valid tokens must be invisible.
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, float("nan"), 0.8]])
    mask = torch.tensor([[True, False, True]])
    adv, ret = A.gae(rewards, values, mask, 1.0, 0.95)
    ref, _ = A.gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]]), torch.ones(1, 2, dtype=torch.bool), 1.0, 0.95)
    close(adv, [[ref[0, 0].item(), 0.0, ref[0, 1].item()]])
    assert torch.isfinite(ret).all()


def slow_gae(rewards, values, mask, gamma, lam, dones, boot):
    """Obvious per-sequence Python reference: compress valid tokens, loop backwards."""
    out_adv = torch.zeros_like(rewards, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t]]
        lam_i = lam[i].item() if isinstance(lam, torch.Tensor) else lam
        next_v = 0.0 if dones[i] else boot[i].item()
        running = 0.0
        for t in reversed(idx):
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            running = delta + gamma * lam_i * running
            out_adv[i, t] = running
            next_v = values[i, t].item()
    return out_adv


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.integers(0, 10_000),
    st.floats(0.5, 1.0),
    st.one_of(st.floats(0.0, 1.0), st.just("per_seq")),
)
def test_gae_agrees_with_a_slow_reference_on_random_shapes(batch, length, seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    dones = torch.rand(batch, generator=gen) < 0.5
    boot = torch.randn(batch, generator=gen, dtype=torch.float64)
    if lam == "per_seq":
        lam = torch.rand(batch, generator=gen, dtype=torch.float64)
    adv, ret = A.gae(rewards, values, mask, gamma, lam, dones, boot)
    close(adv, slow_gae(rewards, values, mask, gamma, lam, dones, boot), atol=1e-10)
    close(ret, torch.where(mask, adv + values, torch.zeros_like(adv)), atol=1e-12)


# ---------------------------------------------------------------- 1.3 VAPO


def test_vapo_policy_lambda_matches_spec_and_is_clamped():
    close(A.vapo_policy_lambda(torch.tensor([40, 200, 1000]), 0.05), [0.5, 0.9, 0.98])
    # Unclamped: l=10 -> -1, l=20 -> 0, l=0 -> -inf.
    close(A.vapo_policy_lambda(torch.tensor([10, 20, 0]), 0.05), [0.0, 0.0, 0.0])


def test_gae_with_lambda_half_on_the_toy_is_flat():
    adv, _ = A.gae(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), VALUES, ONE_SEQ_MASK, 1.0, 0.5)
    close(adv, [[0.2, 0.2, 0.2, 0.2]])


def test_vapo_uses_length_adaptive_policy_lambda_and_monte_carlo_value_targets():
    length = 40  # lambda_policy = 0.5
    rewards = torch.zeros(1, length)
    rewards[0, -1] = 1.0
    values = torch.rand(1, length, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, length, dtype=torch.bool)
    adv, ret = A.vapo(rewards, values, mask, gamma=1.0, alpha=0.05)
    ref_adv, _ = A.gae(rewards, values, mask, 1.0, 0.5)
    close(adv, ref_adv)
    close(ret, torch.ones(1, length))  # lambda_critic = 1, gamma = 1: the MC return


# ---------------------------------------------------------------- 1.4 GRPO


def test_grpo_unbiased_matches_spec(fadv):
    close(
        A.grpo(*fadv).view(3, 3),
        [[1.154699, -0.577349, -0.577349], [0, 0, 0], [-0.832048, 1.109397, -0.277349]],
    )


def test_grpo_biased_and_trl_eps_variants_match_spec(fadv):
    close(
        A.grpo(*fadv, unbiased=False).view(3, 3),
        [[1.414211, -0.707105, -0.707105], [0, 0, 0], [-1.019046, 1.358728, -0.339682]],
    )
    close(
        A.grpo(*fadv, eps=1e-4).view(3, 3),
        [[1.154501, -0.577250, -0.577250], [0, 0, 0], [-0.831820, 1.109093, -0.277273]],
    )


def test_grpo_all_equal_group_is_exactly_zero_despite_round_off():
    # In fp32, mean([0.1] * 7) - 0.1 = -7.5e-9 and mean([0.9] * 3) - 0.9 = 6e-8: without the all-equal
    # check GRPO would divide that by (std + 1e-6) and return ~-0.007 and ~0.06.
    rewards, group_ids = as_groups([[0.1] * 7, [0.9] * 3])
    assert A._Groups(rewards, group_ids).centered.abs().max() > 0  # the hazard is real
    for estimator in (A.grpo, A.dr_grpo, A.rloo, A.batch_normalized, A.maxrl):
        assert torch.equal(estimator(rewards, group_ids), torch.zeros(10)), estimator.__name__


def test_group_of_one_gives_zero_advantage_unlike_verl():
    rewards, group_ids = as_groups([[1.0], [0.7, 0.2]])
    for estimator in (A.grpo, A.dr_grpo, A.rloo, A.batch_normalized, A.maxrl):
        assert estimator(rewards, group_ids)[0].item() == 0.0, estimator.__name__


def test_grpo_handles_ragged_groups_with_unsorted_arbitrary_ids():
    rewards = torch.tensor([1.0, 5.0, 0.0, 7.0, 0.5, 3.0])
    group_ids = torch.tensor([42, 7, 42, 7, 42, -3])  # sizes 3, 2, 1
    out = A.grpo(rewards, group_ids)
    g42 = torch.tensor([1.0, 0.0, 0.5])
    g7 = torch.tensor([5.0, 7.0])
    close(out[[0, 2, 4]], (g42 - g42.mean()) / (g42.std() + 1e-6))
    close(out[[1, 3]], (g7 - g7.mean()) / (g7.std() + 1e-6))
    assert out[5].item() == 0.0


# ---------------------------------------------------------------- 1.5 - 1.9


def test_dr_grpo_matches_spec(fadv):
    close(A.dr_grpo(*fadv).view(3, 3), [[0.666667, -0.333333, -0.333333], [0, 0, 0], [-0.3, 0.4, -0.1]])


def test_rloo_matches_spec(fadv):
    close(A.rloo(*fadv).view(3, 3), [[1.0, -0.5, -0.5], [0, 0, 0], [-0.45, 0.6, -0.15]])


def test_batch_normalized_uses_the_std_of_the_whole_batch(fadv):
    # std(all 9 rewards, ddof=1) = 0.453995; A = (R - mean_g) / (0.453995 + 1e-4).
    close(
        A.batch_normalized(*fadv).view(3, 3),
        [[1.468123, -0.734061, -0.734061], [0, 0, 0], [-0.660655, 0.880874, -0.220218]],
    )
    close(A.batch_normalized(*fadv, batch_std=1.0 - 1e-4).view(3, 3)[0], [0.666667, -0.333333, -0.333333])


def test_maxrl_both_scalings_match_spec(fadv):
    close(
        A.maxrl(*fadv, divide_by_group_size=True).view(3, 3),
        [[0.666667, -0.333333, -0.333333], [0, 0, 0], [-0.2, 0.266667, -0.066667]],
    )
    close(A.maxrl(*fadv, divide_by_group_size=False).view(3, 3), [[2, -1, -1], [0, 0, 0], [-0.6, 0.8, -0.2]])


def test_maxrl_on_binary_groups_is_zero_without_success():
    rewards, group_ids = as_groups([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]])
    close(
        A.maxrl(rewards.float(), group_ids).view(3, 4),
        [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [0.083333, 0.083333, -0.25, 0.083333]],
    )


def reinforce_pp_fixture():
    mask = torch.zeros(4, 5, dtype=torch.bool)
    for row, length in enumerate([3, 2, 4, 1]):
        mask[row, :length] = True
    return torch.tensor([1.0, 0.0, 0.2, 1.0]), torch.tensor([0, 0, 1, 1]), mask


def test_reinforce_pp_whitens_returns_over_tokens():
    rewards, _, mask = reinforce_pp_fixture()
    adv = A.reinforce_pp(rewards, mask)
    # Token mean 0.48, unbiased token std 0.454117: (1 - 0.48) / 0.454117 = 1.145079.
    for row, (value, length) in enumerate(zip([1.145079, -1.056996, -0.616581, 1.145079], [3, 2, 4, 1])):
        close(adv[row, :length], [value] * length)
        assert torch.equal(adv[row, length:], torch.zeros(5 - length))


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    rewards, group_ids, mask = reinforce_pp_fixture()
    adv = A.reinforce_pp_baseline(rewards, group_ids, mask)
    for row, (value, length) in enumerate(zip([1.208850, -0.911940, -0.699861, 0.996771], [3, 2, 4, 1])):
        close(adv[row, :length], [value] * length)


def test_discounted_returns_skip_masked_positions():
    rewards = torch.tensor([[1.0, 100.0, 2.0, 0.0]])
    mask = torch.tensor([[True, False, True, False]])
    close(A.discounted_returns(rewards, mask, 0.5), [[1.0 + 0.5 * 2.0, 0.0, 2.0, 0.0]])
    close(A.discounted_returns(rewards, mask, 1.0), [[3.0, 0.0, 2.0, 0.0]])


def test_masked_whiten_ignores_pads_and_survives_a_single_token():
    x = torch.tensor([[1.0, 3.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    out = A.masked_whiten(x, mask)
    close(out, [[-1 / 2**0.5, 1 / 2**0.5, 0.0]], atol=1e-6)  # var_unbiased = 2
    assert torch.equal(A.masked_whiten(torch.tensor([[5.0]]), torch.ones(1, 1, dtype=torch.bool)), torch.zeros(1, 1))


def test_outcome_reward_lands_on_the_last_valid_token():
    mask = torch.tensor([[True, True, False, False], [False, False, False, False], [True, False, True, False]])
    out = A.outcome_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    close(out, [[0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 3.0, 0]])


def test_advantages_are_detached_constants_even_from_inputs_with_grad(fadv):
    rewards = fadv[0].clone().requires_grad_(True)
    assert not A.grpo(rewards, fadv[1]).requires_grad
    assert not A.batch_normalized(rewards, fadv[1]).requires_grad
    values = VALUES.clone().requires_grad_(True)
    adv, ret = A.gae(torch.zeros(1, 4), values, ONE_SEQ_MASK)
    assert not adv.requires_grad and not ret.requires_grad
