"""Reductions of docs/algorithms.md#reductions: full-batch values, micro-batch / rank invariance, slow reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import losses
from asyncrl.algo.registry import REDUCTIONS
from asyncrl.algo.reduction import aggregate, reduction_stats, reduction_weights, weighted_sum

from .helpers import close, make_fpol

GROUPS = torch.tensor([0, 0, 1])
L_MAX = 4


def dual_clip_loss():
    pol = make_fpol()
    per_token, _ = losses.ppo_clip(pol.logp, pol.old, pol.adv, pol.mask, 0.2, 0.2, dual_clip_c=3.0)
    return pol, per_token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", 0.430829),
        ("seq_mean_token_mean", 0.438472),
        ("seq_mean_token_sum", 1.579705),
        ("seq_mean_token_sum_norm", 0.394926),  # / (B * L_max) = / 12; verl's / L_max would give 1.184779
        ("prompt_mean", 0.722463),
    ],
)
def test_full_batch_reduction_matches_spec(mode, expected):
    pol, per_token = dual_clip_loss()
    close(aggregate(per_token, pol.mask, mode, GROUPS, L_MAX), expected)


@pytest.mark.parametrize(
    "mode, parts",
    [
        ("token_mean", (-0.363245, 0.794073)),
        ("prompt_mean", (-0.285407, 1.007870)),  # group 0 straddles the two micro-batches
        ("seq_mean_token_sum_norm", (-0.332974, 0.727901)),
        ("seq_mean_token_mean", None),
    ],
)
def test_micro_batch_contributions_use_global_denominators(mode, parts):
    pol, per_token = dual_clip_loss()
    weights = reduction_weights(mode, pol.mask, GROUPS, L_MAX)
    first = weighted_sum(per_token[:1], weights[:1])
    second = weighted_sum(per_token[1:], weights[1:])
    if parts is not None:
        close(first, parts[0])
        close(second, parts[1])
    close(first + second, aggregate(per_token, pol.mask, mode, GROUPS, L_MAX).item())


def test_naive_mean_of_local_means_is_wrong():
    pol, per_token = dual_clip_loss()
    naive_token = (
        aggregate(per_token[:1], pol.mask[:1], "token_mean") + aggregate(per_token[1:], pol.mask[1:], "token_mean")
    ) / 2
    close(naive_token, 0.124453)  # spec's wrong value, vs 0.430829
    naive_seq = (
        aggregate(per_token[:1], pol.mask[:1], "seq_mean_token_mean")
        + aggregate(per_token[1:], pol.mask[1:], "seq_mean_token_mean")
    ) / 2
    close(naive_seq, 0.079123)  # vs 0.438472


def slow_reduction(loss, mask, mode, groups, l_max):
    """The table of docs/algorithms.md#reductions written with Python loops over rows and groups."""
    rows = range(loss.shape[0])
    lengths = [int(mask[i].sum()) for i in rows]
    row_sums = [sum(loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t]) for i in rows]
    nonempty = [i for i in rows if lengths[i] > 0]
    if mode == "token_mean":
        return sum(row_sums) / sum(lengths) if sum(lengths) else 0.0
    if mode == "seq_mean_token_mean":
        return sum(row_sums[i] / lengths[i] for i in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq_mean_token_sum":
        return sum(row_sums[i] for i in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq_mean_token_sum_norm":
        return sum(row_sums) / (loss.shape[0] * l_max)
    group_terms = []
    for g in sorted(set(groups.tolist())):
        members = [i for i in rows if groups[i] == g]
        tokens = sum(lengths[i] for i in members)
        if tokens:
            group_terms.append(sum(row_sums[i] for i in members) / tokens)
    return sum(group_terms) / len(group_terms) if group_terms else 0.0


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 6))
    length = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 100_000))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9]))
    groups = torch.randint(0, 3, (batch,), generator=gen)
    logp = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan")))  # pads hold garbage
    cuts = sorted(draw(st.lists(st.integers(1, batch), max_size=3, unique=True)))
    return mask, groups, logp, cuts


def square_loss(logp, mask):
    """A per-token loss with a row-dependent gradient, 0 at pads."""
    x = torch.where(mask, logp, torch.zeros_like(logp))
    return torch.where(mask, x**2 + x, torch.zeros_like(x))


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(REDUCTIONS))
def test_any_row_split_gives_the_whole_batch_loss_and_gradient(batch, mode):
    mask, groups, logp, cuts = batch
    weights = reduction_weights(mode, mask, groups, L_MAX, dtype=torch.float64)

    whole_logp = logp.clone().requires_grad_(True)
    whole = weighted_sum(square_loss(whole_logp, mask), weights)
    (g_whole,) = torch.autograd.grad(whole, whole_logp)

    split_logp = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    bounds = [0, *cuts, logp.shape[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:  # one micro-batch: its own forward, weights sliced from the batch
            total = total + weighted_sum(square_loss(split_logp[lo:hi], mask[lo:hi]), weights[lo:hi])
    (g_split,) = torch.autograd.grad(total, split_logp)

    close(total, whole.item(), atol=1e-12)
    close(g_split, g_whole, atol=1e-12)
    assert torch.isfinite(g_whole).all() and torch.equal(g_whole[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))
    expected = slow_reduction(square_loss(logp, mask), mask, mode, groups, L_MAX)
    close(whole, expected, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(REDUCTIONS))
def test_ranks_summing_local_stats_get_the_global_weights(batch, mode):
    mask, groups, _, cuts = batch
    bounds = [0, *cuts, mask.shape[0]]
    ranks = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    stats = sum(reduction_stats(mask[lo:hi], groups[lo:hi], num_groups=3) for lo, hi in ranks)  # all-reduce SUM
    local = torch.cat([reduction_weights(mode, mask[lo:hi], groups[lo:hi], L_MAX, stats) for lo, hi in ranks])
    close(local, reduction_weights(mode, mask, groups, L_MAX), atol=1e-7)


def test_empty_rows_count_in_dr_grpo_batch_size_but_not_in_the_sequence_means():
    per_token = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    close(aggregate(per_token, mask, "seq_mean_token_sum"), (4.0 + 2.0) / 2)  # B' = 2
    close(aggregate(per_token, mask, "seq_mean_token_mean"), (2.0 + 2.0) / 2)
    close(aggregate(per_token, mask, "seq_mean_token_sum_norm", l_max=2), 6.0 / (3 * 2))  # B = 3
    close(aggregate(per_token, mask, "token_mean"), 6.0 / 3)
    close(aggregate(per_token, mask, "prompt_mean", torch.tensor([0, 1, 1])), (4.0 / 2 + 2.0 / 1) / 2)
    # A group with no valid token does not count in P.
    close(aggregate(per_token, mask, "prompt_mean", torch.tensor([0, 1, 0])), 6.0 / 3)


def test_empty_mask_gives_zero_loss_with_the_graph_still_connected():
    logp = torch.full((2, 3), float("-inf")).requires_grad_(True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in REDUCTIONS:
        per_token, _ = losses.ppo_clip(logp, torch.full((2, 3), float("nan")), torch.ones(2, 3), mask)
        loss = aggregate(per_token, mask, mode, torch.tensor([0, 1]), L_MAX)
        assert loss.item() == 0.0 and loss.requires_grad, mode
        loss.backward()
        assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_reduction_weights_validate_their_inputs():
    mask = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="valid: token_mean"):
        reduction_weights("token_sum", mask)
    with pytest.raises(ValueError, match="l_max"):
        reduction_weights("seq_mean_token_sum_norm", mask)
    with pytest.raises(ValueError, match="group_ids"):
        reduction_weights("prompt_mean", mask)
    with pytest.raises(ValueError, match="dense ids"):
        reduction_stats(mask, torch.tensor([0, 5]), num_groups=2)
