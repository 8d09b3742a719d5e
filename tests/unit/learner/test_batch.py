import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo.registry import REDUCTIONS
from asyncrl.algo.recipes import resolve_recipe
from asyncrl.learner.batch import build_batch, dummy_microbatch, micro_batches, split_mini_batches, split_rows
from asyncrl.testing import make_trajectory
from asyncrl.types import Group

from .helpers import random_groups


def test_each_response_token_is_scored_at_the_column_before_it():
    # prompt [1, 5, 6], response [7, 8, 2] with the middle token from a tool (loss_mask 0).
    t = make_trajectory([7, 8, 2], prompt_ids=[1, 5, 6], rollout_logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 0, 1], reward=1.0)
    batch = build_batch([Group("g0", [t])], resolve_recipe("dapo"))
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8, 2]]
    # column 2 predicts token 7, column 3 predicts 8 (tool token: no loss), column 4 predicts 2.
    assert batch.loss_mask.tolist() == [[False, False, True, False, True, False]]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, 0, -0.3, 0])
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    # token_mean over 2 valid tokens: 1/2 each.
    assert batch.token_weights[0].tolist() == [0, 0, 0.5, 0, 0.5, 0]
    assert batch.dones.tolist() == [True]


def test_rewards_are_shaped_by_the_recipe_before_the_advantages():
    # Overlong penalty with L_max = 3, L_cache = 2: responses of 1, 2, 3 tokens get 0, -0.5, -1.
    members = [make_trajectory([3] * n, prompt_ids=[1], reward=1.0, group_id="a", sample_index=n) for n in (1, 2, 3)]
    recipe = resolve_recipe("dr_grpo", l_max=3, overlong_max_length=3, overlong_cache_length=2)
    batch = build_batch([Group("a", members)], recipe)
    assert batch.rewards.tolist() == [1.0, 0.5, 0.0]
    # Dr. GRPO: A = r - mean(r) = [0.5, 0, -0.5] on each row's tokens.
    assert [batch.advantages[i][batch.loss_mask[i]].tolist() for i in range(3)] == [[0.5], [0.0, 0.0], [-0.5] * 3]


def test_outcome_advantages_and_weights_span_the_whole_batch():
    a0 = make_trajectory([3, 4], prompt_ids=[1], reward=1.0, group_id="a")
    a1 = make_trajectory([3], prompt_ids=[1, 2], reward=0.0, group_id="a", sample_index=1)
    b0 = make_trajectory([5, 6, 7], prompt_ids=[1], reward=0.5, group_id="b")
    b1 = make_trajectory([5], prompt_ids=[1], reward=0.5, group_id="b", sample_index=1, finish_reason="length")
    g0, g1 = Group("a", [a0, a1]), Group("b", [b0, b1])
    batch = build_batch([g0, g1], resolve_recipe("grpo"))
    # GRPO: rewards [1, 0] -> mean 0.5, unbiased std 0.707107 -> A = +-0.707106; group b is all-equal -> 0.
    row_adv = [batch.advantages[i][batch.loss_mask[i]].tolist() for i in range(4)]
    assert row_adv[0] == pytest.approx([0.707106, 0.707106], abs=1e-5)
    assert row_adv[1] == pytest.approx([-0.707106], abs=1e-5)
    assert row_adv[2] == [0, 0, 0] and row_adv[3] == [0]
    # seq_mean_token_mean over B' = 4 sequences: row 0 has 2 tokens -> 1/8 each, row 2 has 3 -> 1/12.
    assert batch.token_weights[0][batch.loss_mask[0]].tolist() == pytest.approx([1 / 8, 1 / 8])
    assert batch.token_weights[2][batch.loss_mask[2]].tolist() == pytest.approx([1 / 12] * 3)
    assert float(batch.token_weights.sum()) == pytest.approx(1.0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.num_groups == 2
    assert batch.dones.tolist() == [True, True, True, False]


def test_mini_batches_keep_the_rollout_batch_advantages_and_reweight_over_themselves():
    # Groups a (rewards 1, 0), b (1, 0, token-lengths 1 and 3), c (0.5, 0.5), d (1, 1); two mini-batches: {a, b}, {c, d}.
    groups = [
        Group("a", [make_trajectory([3, 4], prompt_ids=[1], reward=1.0, group_id="a"), make_trajectory([3], prompt_ids=[1], reward=0.0, group_id="a", sample_index=1)]),
        Group("b", [make_trajectory([5], prompt_ids=[1], reward=1.0, group_id="b"), make_trajectory([5, 6, 7], prompt_ids=[1], reward=0.0, group_id="b", sample_index=1)]),
        Group("c", [make_trajectory([8], prompt_ids=[1], reward=0.5, group_id="c"), make_trajectory([8], prompt_ids=[1], reward=0.5, group_id="c", sample_index=1)]),
        Group("d", [make_trajectory([9, 9], prompt_ids=[1], reward=1.0, group_id="d"), make_trajectory([9], prompt_ids=[1], reward=1.0, group_id="d", sample_index=1)]),
    ]
    recipe = resolve_recipe("dapo")  # GRPO advantages, token-mean reduction
    batch = build_batch(groups, recipe)
    first, second = split_mini_batches(batch, 2, recipe)
    assert first.group_ids.tolist() == [0, 0, 1, 1] and second.group_ids.tolist() == [2, 2, 3, 3]
    assert first.num_groups == second.num_groups == 4  # ids stay those of the rollout batch
    # Advantages are the rollout batch's rows, untouched: +-0.707106 in a and b, 0 in c and d.
    assert torch.equal(first.advantages, batch.advantages[:4, : first.advantages.shape[1]])
    assert first.advantages[0, 1].item() == pytest.approx(0.707106, abs=1e-5)  # 0.5 / (std 0.707107 + eps)
    # Token-mean over each mini-batch: 7 loss tokens in {a, b} -> 1/7 each; 5 in {c, d} -> 1/5 (whole batch: 1/12).
    assert first.token_weights[first.loss_mask].tolist() == pytest.approx([1 / 7] * 7)
    assert second.token_weights[second.loss_mask].tolist() == pytest.approx([1 / 5] * 5)
    assert second.value_weights[second.loss_mask].tolist() == pytest.approx([1 / 5] * 5)
    assert split_mini_batches(batch, 1, recipe)[0] is batch


def test_mini_batches_deal_whole_groups_in_order_and_the_first_runs_take_the_remainder():
    recipe = resolve_recipe("grpo")
    batch = build_batch(random_groups(num_groups=5, group_size=2, seed=4), recipe)
    parts = split_mini_batches(batch, 3, recipe)
    assert [p.group_ids.unique().tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert sum(p.num_rows for p in parts) == batch.num_rows
    assert [p.group_ids.unique().tolist() for p in split_mini_batches(batch, 8, recipe)] == [[g] for g in range(5)]
    with pytest.raises(ValueError, match="mini_batches must be >= 1"):
        split_mini_batches(batch, 0, recipe)


def test_an_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        build_batch([Group("g", [make_trajectory([3, 4], prompt_ids=[])])], resolve_recipe("dapo"))


def test_split_rows_partitions_rows_and_balances_tokens():
    batch = build_batch(random_groups(num_groups=6, group_size=3, seed=1), resolve_recipe("dapo"))
    shards = split_rows(batch, 3)
    # Every row lands on exactly one rank (compare the unpadded token sequences as multisets).
    def rows(b):
        return sorted(tuple(r[:n]) for r, n in zip(b.input_ids.tolist(), b.seq_lens.tolist()))

    assert sorted(r for s in shards for r in rows(s)) == rows(batch)
    assert sum(s.num_rows for s in shards) == batch.num_rows
    assert sum(s.num_tokens for s in shards) == batch.num_tokens
    loads = [s.num_tokens for s in shards]
    assert max(loads) - min(loads) <= int(batch.seq_lens.max())  # greedy longest-first bound


def test_split_rows_keeps_groups_together_when_asked():
    batch = build_batch(random_groups(num_groups=5, group_size=3, seed=2), resolve_recipe("gvpo"))
    for shard in split_rows(batch, 2, keep_groups=True):
        for g in shard.group_ids.unique().tolist():
            assert int((shard.group_ids == g).sum()) == 3


def test_more_ranks_than_rows_gives_empty_shards():
    batch = build_batch(random_groups(num_groups=1, group_size=2), resolve_recipe("dapo"))
    shards = split_rows(batch, 4)
    assert [s.num_rows for s in shards].count(0) == 2
    assert micro_batches(shards[-1], 8) == []


def test_micro_batches_respect_the_padded_token_budget():
    batch = build_batch(random_groups(num_groups=6, group_size=4, seed=3), resolve_recipe("dapo"))
    budget = 24
    mbs = micro_batches(batch, budget)
    assert sum(mb.num_rows for mb in mbs) == batch.num_rows
    for mb in mbs:
        width = mb.input_ids.shape[1]
        assert width == int(mb.seq_lens.max())
        assert mb.num_rows * width <= budget or mb.num_rows == 1


def test_dummy_microbatch_carries_no_weight():
    mb = dummy_microbatch()
    assert not mb.loss_mask.any() and float(mb.token_weights.abs().sum()) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    reduction=st.sampled_from(REDUCTIONS),
    num_ranks=st.integers(1, 4),
    budget=st.integers(1, 40),
    keep_groups=st.booleans(),
)
def test_slices_of_the_batch_sum_to_the_batch_loss(seed, reduction, num_ranks, budget, keep_groups):
    """Any per-token loss weighted by the batch's token_weights sums to the same number over ranks and
    micro-batches (the exactness the learner relies on; the loss here rides in `advantages`)."""
    recipe = resolve_recipe(advantage="dr_grpo", loss="ppo", reduction=reduction, l_max=8)
    batch = build_batch(random_groups(num_groups=4, group_size=3, seed=seed), recipe)
    batch.advantages = torch.from_numpy(np.random.default_rng(seed).normal(size=batch.advantages.shape)).float()
    whole = float((batch.advantages * batch.token_weights).double().sum())
    pieces = 0.0
    for shard in split_rows(batch, num_ranks, keep_groups):
        for mb in micro_batches(shard, budget, keep_groups):
            pieces += float((mb.advantages * mb.token_weights).double().sum())
    assert pieces == pytest.approx(whole, abs=1e-6)
