"""Packed micro-batches and shared group prompts (`asyncrl.learner.packing`): the layout by hand, and one rank's
log-probs, loss, gradients, mismatch figures, step and critic values equal the padded rows' (fp32, float rounding).
Per family: tests/unit/learner/test_family_logprobs.py; two gloo ranks: tests/integration/test_learner.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch, split_rows
from asyncrl.learner.packing import packed_micro_batches, shared_groups
from asyncrl.testing import make_trajectory, random_groups
from asyncrl.types import Group

RECIPES = {
    "cispo": resolve_recipe("cispo"),
    "gvpo": resolve_recipe("gvpo"),  # whole groups per micro-batch
    "dapo/mis/after_rejection": resolve_recipe("dapo", correction="mis", denominator_after_rejection=True),
}
"""A token-sum, a group-coupled (whole groups per micro-batch) and a rank-side-weights reduction; the two-rank
integration test runs these and more against a plain padded computation."""


def _group(name, prompt, responses):
    members = [
        make_trajectory(r, prompt_ids=prompt, group_id=name, sample_index=i, rollout_logprobs=[-1.0] * len(r))
        for i, r in enumerate(responses)
    ]
    return Group(name, members)


def test_a_shared_prompt_layout_by_hand():
    batch = build_batch([_group("a", [5, 6], [[7, 8], [9]]), _group("b", [4], [[3, 5]])], RECIPES["cispo"])
    (mb,) = packed_micro_batches(batch, 4096, share=True)
    layout = mb.layout
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 5]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert layout.block.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]] and layout.tokens == 8
    mask = layout.attention_mask(type("C", (), {"_attn_implementation": "sdpa"})(), torch.float32)[0, 0].int()
    assert mask[4].tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # response [9] sees the prompt and itself
    assert mask[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert mask[7].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    # Rows keep the padded layout: row 1 is [5, 6, 9]; its column 1 (predicting 9) reads slot 1, as row 0's does.
    assert mb.input_ids[:, :4].tolist() == [[5, 6, 7, 8], [5, 6, 9, 0], [4, 3, 5, 0]]
    assert layout.token_slot.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1], [5, 6, 7, -1]]
    queries = list(zip(layout.query_slot.tolist(), layout.query_target.tolist(), strict=True))
    pairs = [[queries[q] if q < len(queries) else None for q in row] for row in layout.column_query.tolist()]
    assert pairs == [[(0, 6), (1, 7), (2, 8), None], [(0, 6), (1, 9), None, None], [(5, 3), (6, 5), None, None]]
    assert len(queries) == 6  # 7 columns, (0, 6) once for both rows


def test_unshared_prompts_and_routes_are_not_shared():
    batch = build_batch([_group("a", [5, 6], [[7], [8]]), _group("b", [4], [[3], [5]])], RECIPES["cispo"])
    assert shared_groups(batch) == [[0, 1], [2, 3]]
    other = build_batch(
        [Group("a", [*_group("a", [5, 6], [[7]]).trajectories, *_group("a", [5, 3], [[8]]).trajectories])],
        RECIPES["cispo"],
    )
    assert shared_groups(other) == []
    routes = torch.zeros(4, batch.input_ids.shape[1], 1, 2, dtype=torch.int16)
    routes[1, 0] = 1  # row 1 was routed otherwise on its prompt
    import dataclasses

    assert shared_groups(dataclasses.replace(batch, routed_experts=routes)) == [[2, 3]]


def test_the_budget_bounds_each_micro_batchs_slots():
    batch = build_batch(random_groups(num_groups=6, group_size=4, seed=3, shared_prompts=True), RECIPES["cispo"])
    mbs = packed_micro_batches(batch, 24, share=True)
    assert all(mb.num_slots <= 24 for mb in mbs) and len(mbs) > 2
    assert sorted(int(i) for mb in mbs for i in mb.seq_lens) == sorted(batch.seq_lens.tolist())
    assert sum(mb.layout.tokens for mb in mbs) < batch.num_tokens  # prompts counted once
    whole = packed_micro_batches(batch, 24, share=False, keep_groups=True)
    assert all(len(set(mb.group_ids.tolist())) == mb.num_rows // 4 for mb in whole)


def test_ranks_keep_a_shared_group_together_and_balance_its_tokens():
    # Group a: prompt 4 + responses 1, 1, 1 (7 tokens shared, 15 unshared); b and c: 5 tokens each, unshared.
    groups = [_group("a", [3] * 4, [[5], [6], [7]]), _group("b", [4], [[5] * 4]), _group("c", [9], [[5] * 4])]
    batch = build_batch(groups, RECIPES["cispo"])
    a, bc = split_rows(batch, 2, share_prompts=True)
    assert a.group_ids.tolist() == [0, 0, 0] and bc.group_ids.tolist() == [1, 2]
    rows = [s.group_ids.tolist() for s in split_rows(batch, 2)]  # unshared: rows of 5 tokens spread
    assert sorted(len(r) for r in rows) == [2, 3]


def _state(model_dir, **config):
    from asyncrl.learner.state import build_train_state

    torch.manual_seed(0)
    return build_train_state(LearnerConfig(lr=1e-2, **config), str(model_dir), torch.device("cpu"), lambda m: None)


def _rank_step(state, recipe, config):
    from asyncrl.learner.step import RankStep

    return RankStep(state, config, recipe, RAW, torch.device("cpu"), lambda t, op="sum": t)


def _run(model_dir, recipe, batch, **config):
    """(per-token log-probs by row, gradients, loss, the step's stats, the weights after it) on one rank."""
    cfg = LearnerConfig(lr=1e-2, tokens_per_microbatch=48, **config)
    state = _state(model_dir, **config)
    step = _rank_step(state, recipe, cfg)
    mbs, _ = step._micro_batches(batch)
    assert all((mb.layout is not None) == cfg.packing for mb in mbs)
    logprobs = {}
    with torch.no_grad():
        for mb in mbs:
            out = step._logprobs(mb)
            logprobs.update({_key(mb, b): out[b, : int(mb.seq_lens[b]) - 1] for b in range(mb.num_rows)})
    loss, grads = step.gradients(batch)
    stats = step.train([batch], 0)
    metrics = {k: v for k, v in stats.metrics.items() if not k.endswith("_s")}
    return (
        logprobs,
        grads,
        loss,
        (stats.loss, stats.grad_norm, metrics),
        {n: p.detach().clone() for n, p in state.policy.named_parameters()},
    )


def _key(mb, b):
    return int(mb.group_ids[b]), tuple(mb.input_ids[b, : int(mb.seq_lens[b])].tolist())


@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_and_shared_steps_equal_the_padded_step(tiny_model_dir, name):
    recipe = RECIPES[name]
    groups = random_groups(num_groups=3, group_size=4, seed=7, shared_prompts=True)
    groups += random_groups(num_groups=2, group_size=2, seed=8)  # prompts differ within a group: not shared
    batch = build_batch(groups, recipe)
    padded = _run(tiny_model_dir, recipe, batch, packing=False)
    for share in (False, True):
        logprobs, grads, loss, (s_loss, s_norm, metrics), after = _run(
            tiny_model_dir, recipe, batch, packing=True, share_group_prompt=share
        )
        assert logprobs.keys() == padded[0].keys()
        assert max(float((logprobs[k] - padded[0][k]).abs().max()) for k in logprobs) < 2e-6
        assert max(float(np.abs(grads[k] - padded[1][k]).max()) for k in grads) < 1e-6
        assert max(float(np.abs(g).max()) for g in grads.values()) > 1e-3  # a real gradient
        assert loss == pytest.approx(padded[2], abs=1e-6) and s_loss == pytest.approx(padded[3][0], abs=1e-6)
        assert s_norm == pytest.approx(padded[3][1], rel=1e-5)
        assert metrics.keys() == padded[3][2].keys()
        # The mismatch figures are sums over tokens; other metrics merge micro-batch means (partition-dependent).
        for key in [k for k in metrics if k.startswith("mismatch_")] + ["loss_tokens", "updates"]:
            assert metrics[key] == pytest.approx(padded[3][2][key], rel=1e-5, abs=1e-6), key
        assert metrics["mismatch_logprob_abs_diff_mean"] > 0.1  # the fake rollout log-probs are not the learner's


def test_a_shared_forward_computes_each_groups_prompt_once(tiny_model_dir):
    groups = random_groups(num_groups=4, group_size=4, seed=5, shared_prompts=True)
    batch = build_batch(groups, RECIPES["cispo"])
    prompts = sum(len(g.trajectories[0].prompt_ids) for g in groups)
    (mb,) = packed_micro_batches(batch, 4096, share=True)
    assert mb.layout.tokens == batch.num_tokens - 3 * prompts


def test_packed_critic_values_equal_the_padded_ones(tiny_model_dir):
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=4, shared_prompts=True), RECIPES["cispo"])
    critic = _state(tiny_model_dir, critic=True).critic
    (mb,) = packed_micro_batches(batch, 4096, share=True)
    with torch.no_grad():
        padded = critic(mb.input_ids, mb.attention_mask, mb.position_ids)
        packed = critic(mb.input_ids, mb.attention_mask, mb.position_ids, mb.layout)
    real = mb.attention_mask.bool()
    assert float((padded - packed)[real].abs().max()) < 1e-6 and float(packed[~real].abs().max()) == 0.0
