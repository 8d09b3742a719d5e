"""LearnerPool on Ray with the tiny model: 1 vs 2 ranks exactness, log-prob parity, weight export,
checkpoint round trip, Hugging Face export, critic training."""

import numpy as np
import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW, SamplingDistribution
from asyncrl.config import LearnerConfig, WeightSyncConfig
from asyncrl.learner.packing import shared_groups
from asyncrl.testing import random_groups as make_groups

pytestmark = pytest.mark.integration


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


RECIPE = resolve_recipe("cispo")  # batch-normalised advantages, CISPO, prompt-mean: group-level denominators
BUDGET_GB = 0.003


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_model_dir):
    from asyncrl.learner.pool import LearnerPool

    # One rank with one micro-batch vs two ranks with many micro-batches of at most 12 padded tokens.
    one = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=1, tokens_per_microbatch=4096, lr=1e-2), RECIPE)
    # A train-state budget one rank exceeds (3.97 MB) and each of two ranks fits (1.98 MB): `learner.memory`.
    # The two ranks checkpoint their layers' activations (recomputed inside each FSDP2 unit): the same numbers.
    config = LearnerConfig(
        num_ranks=2, tokens_per_microbatch=12, lr=1e-2, rank_memory_gb=BUDGET_GB, activation_checkpointing=True
    )
    two = LearnerPool(tiny_model_dir, config, RECIPE)
    yield one, two
    one.shutdown()
    two.shutdown()


EXACTNESS_RECIPES = {
    "cispo/prompt_mean": RECIPE,
    # GVPO couples a group's sequences: whole groups per rank and micro-batch.
    "gvpo/seq_mean_token_sum": resolve_recipe("gvpo"),
    # Token-mean denominators count the tokens MIS keeps, known only after the learner recompute:
    # rank-side weights from all-reduced statistics.
    "dapo/mis/after_rejection": resolve_recipe("dapo", correction="mis", denominator_after_rejection=True),
    # Batch-normalised TIS divides by the mean TIS weight of the whole batch, summed over micro-batches and ranks.
    "grpo/tis/batch_normalize": resolve_recipe("grpo", correction="tis", tis_batch_normalize=True),
    # The KL to the reference policy (the starting weights, sharded over the two ranks): k1's gradient is the
    # policy's log-prob gradient even where the policy is the reference, so the term's reduction is exercised.
    "grpo/kl_k1": resolve_recipe("grpo", kl_coef=0.5, kl_estimator="k1"),
}


@pytest.mark.parametrize("name", list(EXACTNESS_RECIPES))
def test_two_ranks_with_micro_batches_give_the_one_rank_loss_and_gradient(pools, name, tiny_model_dir):
    one, two = pools
    recipe = EXACTNESS_RECIPES[name]
    # Both pools pack (`learner.packing`) and share each group's prompt segment; the reference below is padded rows.
    batch = one.make_batch(make_groups(seed=1, shared_prompts=True), recipe)
    assert len(shared_groups(batch)) == 4
    loss_1, grads_1 = one.compute_gradients(batch, recipe)
    loss_2, grads_2 = two.compute_gradients(batch, recipe)
    diff = max_abs_diff(grads_1, grads_2)
    print(f"{name}: max |grad diff| 1 vs 2 ranks: {diff:.3e}; loss {loss_1:.9f} vs {loss_2:.9f}")
    assert "model.embed_tokens.weight" in grads_1 and len(grads_1) == 50
    assert max(float(np.abs(g).max()) for g in grads_1.values()) > 1e-3  # a real gradient
    assert loss_2 == pytest.approx(loss_1, abs=1e-6)
    assert diff < 1e-6
    # Both equal a plain single-process computation over the whole batch (no FSDP, no splitting).
    loss_ref, grads_ref = _plain_loss_and_gradients(tiny_model_dir, one.state_snapshot()["params"], batch, recipe)
    assert loss_1 == pytest.approx(loss_ref, abs=1e-6)
    assert max_abs_diff(grads_1, grads_ref) < 1e-6


def _plain_loss_and_gradients(tiny_model_dir, params, batch, recipe):
    from asyncrl.algo.recipes import compute_policy_loss, compute_token_weights, tis_normalizer_stats
    from asyncrl.learner.policy import PolicyModel, hf_name, load_causal_lm

    model = PolicyModel(_reference_model(tiny_model_dir, params))
    logprobs = model(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    old = logprobs.detach()
    weights = compute_token_weights(recipe, batch.loss_mask, batch.group_ids, old, batch.rollout_logprobs)
    tis_stats = tis_normalizer_stats(recipe, batch.loss_mask, old, batch.rollout_logprobs) if recipe.normalizes_tis else None
    ref = None
    if recipe.kl_coef > 0:  # the reference policy: the starting weights
        with torch.no_grad():
            ref = PolicyModel(load_causal_lm(str(tiny_model_dir)))(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    loss, _ = compute_policy_loss(
        recipe, logprobs, old, batch.rollout_logprobs, batch.advantages, batch.loss_mask, weights, batch.group_ids,
        ref_logprobs=ref, tis_stats=tis_stats,
    )
    loss.backward()
    return float(loss.detach()), {hf_name(n): p.grad.numpy() for n, p in model.named_parameters()}


def test_one_train_step_gives_the_same_loss_norm_and_weights_on_one_and_two_ranks(pools):
    one, two = pools
    groups = make_groups(seed=2)
    before = one.state_snapshot()["params"]
    _, grads = one.compute_gradients(one.make_batch(groups))
    stats_1, stats_2 = one.train_step(groups), two.train_step(groups)
    assert stats_2.loss == pytest.approx(stats_1.loss, abs=1e-6)
    assert stats_2.grad_norm == pytest.approx(stats_1.grad_norm, rel=1e-6)
    assert stats_1.num_samples == stats_2.num_samples == 12
    assert stats_1.num_tokens == stats_2.num_tokens == sum(g.num_tokens for g in groups)
    assert stats_1.step == stats_2.step
    # Mismatch metrics compare the learner's own log-probs with the rollout ones: the same on both pools.
    for key in ("mismatch_k3_kl", "mismatch_kl", "mismatch_logprob_abs_diff_mean", "mismatch_logprob_abs_diff_max"):
        assert stats_2.metrics[key] == pytest.approx(stats_1.metrics[key], abs=1e-5), key
    assert stats_1.metrics["mismatch_logprob_abs_diff_mean"] > 0.1  # the fake rollout log-probs are not the learner's
    # Adam's first step is lr * g / (|g| + eps) ~ lr * sign(g): where |g| is itself at the ~1e-8 level of
    # summation-order differences the two pools may move a weight differently (by up to 2 lr). Wherever the
    # gradient is well above that noise the step must be identical.
    after_1, after_2 = one.state_snapshot()["params"], two.state_snapshot()["params"]
    for name, g in grads.items():
        clear = np.abs(g) > 1e-5
        assert np.abs(after_1[name] - after_2[name])[clear].max(initial=0.0) < 1e-6, name
        # ... and it is a real step of ~lr = 1e-2 (clipping scales g, not Adam's normalised update).
        assert np.abs(after_1[name] - before[name])[clear].min(initial=1e-2) > 5e-3, name


def _reference_model(tiny_model_dir, params):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.load_state_dict({k: torch.tensor(v) for k, v in params.items()})
    return model.eval()


def _reference_logprobs(model, token_ids, prompt_len, temperature):
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[prompt_len - 1 :, 0].numpy()


def test_score_equals_a_transformers_fp32_forward_with_temperature(pools, tiny_model_dir):
    _, two = pools
    reference = _reference_model(tiny_model_dir, two.state_snapshot()["params"])
    tokens, prompt_len = [1, 5, 6, 7, 4, 9, 12, 3, 2], 3
    for temperature in (1.0, 0.6):
        learner = two.score(tokens, prompt_len, SamplingDistribution(temperature))
        expected = _reference_logprobs(reference, tokens, prompt_len, temperature)
        assert learner.shape == (len(tokens) - prompt_len,)
        assert np.abs(learner - expected).max() < 1e-6


class _FakeRolloutPool:
    """Records what a rollout pool would load: (version, in_flight, timeout_s, number of buckets, tensors)."""

    def __init__(self):
        self.calls = []

    def start_update(self, refs, version, in_flight):
        import ray

        from asyncrl.weights.buckets import unpack_bucket

        tensors = {}
        for data in ray.get(list(refs)):
            tensors.update(unpack_bucket(data))
        self.started = (version, in_flight, len(refs), tensors)
        return {}

    def finish_update(self, calls, version, timeout_s):
        started_version, in_flight, num_buckets, tensors = self.started
        assert version == started_version
        self.calls.append((version, in_flight, timeout_s, num_buckets, tensors))


def test_published_buckets_hold_every_parameter_under_hf_names_with_the_tied_head(pools):
    from asyncrl.weight_sync.object_store import ObjectStoreSync

    _, two = pools
    params = two.state_snapshot()["params"]
    sink = _FakeRolloutPool()
    sync = ObjectStoreSync(two, sink, WeightSyncConfig(bucket_bytes=1 << 16, timeout_s=7.0), mode="streaming")
    update = sync.finish(sync.start(version=5))
    (version, in_flight, timeout_s, num_buckets, tensors) = sink.calls[0]
    assert (version, in_flight, timeout_s) == (5, True, 7.0)
    assert sync.latest().version == 5 and update.version == 5
    assert num_buckets == update.num_buckets > 1  # ~1.2 MB of fp32 weights in 64 KiB buckets
    assert update.num_tensors == len(tensors) == len(params) == 51  # 50 parameters + the tied lm_head.weight
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    for name, value in params.items():
        assert np.array_equal(tensors[name].numpy(), value), name


@pytest.mark.parametrize("saved_by", [2, 1])
def test_checkpoint_restores_parameters_optimizer_step_version_and_extra_into_another_pool_size(pools, tiny_model_dir, tmp_path, saved_by):
    """Two FSDP ranks -> one rank, and one rank (a plain module: `policy.uses_fsdp`) -> two FSDP ranks."""
    from asyncrl.learner.pool import LearnerPool

    source = pools[saved_by - 1]
    source.train_step(make_groups(seed=4))
    extra = {"queue": {"pending": ["g1", "g2"]}, "counters": {"dispatched": 12, "trained": 9}}
    source.save_checkpoint(tmp_path / "ckpt", 7, extra)
    saved = source.state_snapshot()

    restored = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=3 - saved_by, tokens_per_microbatch=64, lr=1e-2), RECIPE)
    try:
        checkpoint = restored.load_checkpoint(tmp_path / "ckpt")
        assert checkpoint.extra == extra
        assert (restored.step, checkpoint.step, checkpoint.version) == (source.step, source.step, 7)
        loaded = restored.state_snapshot()
        assert loaded["step"] == saved["step"] and loaded["lr"] == saved["lr"]
        assert max_abs_diff(saved["params"], loaded["params"]) == 0.0
        assert max_abs_diff(saved["optimizer"], loaded["optimizer"]) == 0.0
        assert any(k.endswith("/exp_avg_sq") for k in loaded["optimizer"])
        # The restored pool continues like the original one: same loss; the weights agree up to Adam's
        # amplification of ~1e-8 summation-order differences in tiny gradients (see above).
        groups = make_groups(seed=5)
        assert restored.train_step(groups).loss == pytest.approx(source.train_step(groups).loss, abs=1e-6)
        assert max_abs_diff(source.state_snapshot()["params"], restored.state_snapshot()["params"]) < 1e-4
    finally:
        restored.shutdown()


def test_an_incomplete_checkpoint_is_refused(pools, tmp_path):
    _, two = pools
    with pytest.raises(FileNotFoundError, match="not a complete learner checkpoint"):
        two.load_checkpoint(tmp_path / "nothing-here")


def test_export_hf_loads_in_transformers_with_identical_logits(pools, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, two = pools
    two.export_hf(tmp_path / "hf")
    params = two.state_snapshot()["params"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).vocab_size == model.config.vocab_size
    state = model.state_dict()
    for name, value in params.items():
        assert np.array_equal(state[name].numpy(), value), name
    tokens, prompt_len = [1, 4, 8, 10, 3, 5, 2], 2
    exported = _reference_logprobs(model, tokens, prompt_len, 1.0)
    assert np.abs(two.score(tokens, prompt_len, RAW) - exported).max() < 1e-6


def test_critic_steps_reduce_the_value_loss_and_the_policy_waits_for_critic_warmup(ray_cluster, tiny_model_dir):
    from asyncrl.learner.pool import LearnerPool

    # GAE from critic values, whitened with batch-global moments; lam = 1 makes the value targets Monte-Carlo
    # returns (fixed except for the bootstrap of truncated rows), so the regression loss must go down.
    # For the first `critic_warmup_steps` only the critic learns: the policy's log-probs do not move.
    recipe = resolve_recipe("ppo_gae", lam=1.0)
    config = LearnerConfig(num_ranks=2, tokens_per_microbatch=16, critic=True, critic_lr=5e-4, lr=1e-3, critic_warmup_steps=2)
    pool = LearnerPool(tiny_model_dir, config, recipe)
    try:
        groups = make_groups(num_groups=4, group_size=1, seed=6)
        for group in groups:  # terminal rows: the targets are the rewards, nothing bootstraps
            group.trajectories = [t.replace(finish_reason="stop") for t in group.trajectories]
        probe = [1, 4, 8, 10, 3, 5, 2]
        scores, losses, frozen = [pool.score(probe, 2, RAW)], [], []
        for _ in range(4):
            stats = pool.train_step(groups)
            losses.append(stats.metrics["critic_value_loss"])
            frozen.append(stats.metrics["policy_frozen"])
            scores.append(pool.score(probe, 2, RAW))
        print("critic value loss per step:", losses)
        assert frozen == [1.0, 1.0, 0.0, 0.0]
        assert np.array_equal(scores[0], scores[1]) and np.array_equal(scores[1], scores[2])
        assert np.abs(scores[3] - scores[2]).max() > 1e-4
        assert all(b < a for a, b in zip(losses, losses[1:]))
        assert losses[-1] < 0.7 * losses[0]
    finally:
        pool.shutdown()


# PPO's clip acts on rho = pi_theta / pi_old and DIS gates q = pi_theta / mu = rho * kappa: with one update
# both are inert (rho = 1, q = kappa); with four mini-batches they act from the second update on.
MINI_BATCH_RECIPE = resolve_recipe("grpo", loss="ppo", correction="dis")


def _mini_batch_pool(tiny_model_dir, num_ranks, tokens_per_microbatch, recipe=MINI_BATCH_RECIPE, **config):
    from asyncrl.learner.pool import LearnerPool

    config = LearnerConfig(num_ranks=num_ranks, tokens_per_microbatch=tokens_per_microbatch, lr=1e-2, mini_batches=4, **config)
    return LearnerPool(tiny_model_dir, config, recipe)


def _mini_batches(pool, groups):
    from asyncrl.learner.batch import split_mini_batches

    return split_mini_batches(pool.make_batch(groups), pool.config.mini_batches, pool.recipe)


def test_each_mini_batch_loss_and_gradient_is_that_mini_batch_computed_whole(pools, tiny_model_dir):
    from asyncrl.learner.batch import split_mini_batches

    _, two = pools  # two ranks, micro-batches of at most 12 padded tokens
    batch = two.make_batch(make_groups(num_groups=8, seed=7), RECIPE)
    params = two.state_snapshot()["params"]
    parts = split_mini_batches(batch, 4, RECIPE)
    assert [p.num_rows for p in parts] == [6, 6, 6, 6]
    for i, part in enumerate(parts):
        loss, grads = two.compute_gradients(part, RECIPE)
        loss_ref, grads_ref = _plain_loss_and_gradients(tiny_model_dir, params, part, RECIPE)
        scale = max(float(np.abs(g).max()) for g in grads_ref.values())
        print(f"mini-batch {i}: loss {loss:.9f} vs whole {loss_ref:.9f}; max |grad diff| {max_abs_diff(grads, grads_ref):.3e} of {scale:.3f}")
        assert loss == pytest.approx(loss_ref, abs=1e-6)
        assert max_abs_diff(grads, grads_ref) < 1e-6 * max(1.0, scale)  # fp32 summation order, relative to the gradient


def test_four_mini_batches_agree_on_one_and_two_ranks_and_the_clip_acts_from_the_second(ray_cluster, tiny_model_dir):
    groups = make_groups(num_groups=8, seed=8)
    runs = {}
    for num_ranks, budget in ((1, 4096), (2, 12)):
        pool = _mini_batch_pool(tiny_model_dir, num_ranks, budget)
        try:
            before = pool.state_snapshot()["params"]
            first_loss, _ = pool.compute_gradients(_mini_batches(pool, groups)[0])
            runs[num_ranks] = (first_loss, pool.train_step(groups), before, pool.state_snapshot()["params"])
        finally:
            pool.shutdown()
    (first_loss, stats_1, before, after), (_, stats_2, _, after_2) = runs[1], runs[2]
    m1, m2 = stats_1.metrics, stats_2.metrics
    print({k: (round(m1[k], 6), round(m2[k], 6)) for k in sorted(m1) if "_mb" in k})
    assert (stats_1.step, m1["updates"], m1["kl_stopped"]) == (stats_2.step, m2["updates"], m2["kl_stopped"]) == (1, 4.0, 0.0)
    assert stats_1.num_samples == stats_2.num_samples == 24
    for key in [f"{name}_mb{i}" for i in range(4) for name in ("loss", "clipfrac", "approx_kl")]:
        assert m2[key] == pytest.approx(m1[key], abs=1e-5), key
    # The first update starts at pi_old itself: its loss is mini-batch 0's plain loss, rho = 1, KL 0, no clip.
    assert m1["loss_mb0"] == pytest.approx(first_loss, abs=1e-6)
    assert m1["approx_kl_mb0"] == pytest.approx(0.0, abs=1e-9) and m1["clipfrac_mb0"] == 0.0
    # From the second on pi_theta has moved away from the pi_old of before the first update (kept, not
    # recomputed): KL > 0, so q = rho * kappa != kappa for DIS, and PPO clips tokens.
    for i in (1, 2, 3):
        assert m1[f"approx_kl_mb{i}"] > 1e-3 and m1[f"clipfrac_mb{i}"] > 0.02, i
    assert m1["approx_kl"] == m1["approx_kl_mb3"] and m1["approx_kl_max"] >= m1["approx_kl_mb1"]
    # Four Adam steps of lr 1e-2: weights whose gradient kept its sign moved by about 4 lr (one step: <= lr).
    assert max(float(np.abs(after[k] - before[k]).max()) for k in before) > 3e-2
    assert max_abs_diff(after, after_2) < 1e-3


def test_kl_stop_ends_the_step_on_every_rank_after_the_first_update(ray_cluster, tiny_model_dir):
    pool = _mini_batch_pool(tiny_model_dir, 2, 12, kl_stop=1e-6)
    try:
        before = pool.state_snapshot()["params"]
        stats = pool.train_step(make_groups(num_groups=8, seed=8))
        after = pool.state_snapshot()["params"]
    finally:
        pool.shutdown()
    m = stats.metrics
    assert (stats.step, m["updates"], m["kl_stopped"]) == (1, 1.0, 1.0)
    # Update 1 measured KL(pi_old || pi_theta) > 1e-6 in its forward and was not taken; nothing after it ran.
    assert m["approx_kl_mb1"] > 1e-6 and m["approx_kl"] == m["approx_kl_mb1"]
    assert "loss_mb2" not in m and "clipfrac_mb2" not in m
    assert stats.loss == pytest.approx(m["loss_mb0"])
    # Exactly one Adam step: no weight moved by more than lr = 1e-2 (the first step is lr * g / (|g| + eps)).
    moved = max(float(np.abs(after[k] - before[k]).max()) for k in before)
    assert 5e-3 < moved <= 1e-2 * (1 + 1e-5)


def test_two_epochs_with_a_critic_keep_pi_old_and_still_wait_for_critic_warmup(ray_cluster, tiny_model_dir):
    recipe = resolve_recipe("ppo_gae", lam=1.0)
    pool = _mini_batch_pool(tiny_model_dir, 2, 16, recipe, critic=True, critic_lr=5e-4, critic_warmup_steps=1, epochs=2)
    try:
        groups = make_groups(num_groups=4, group_size=1, seed=6)
        for group in groups:  # terminal rows: the value targets are the rewards, nothing bootstraps
            group.trajectories = [t.replace(finish_reason="stop") for t in group.trajectories]
        probe = [1, 4, 8, 10, 3, 5, 2]
        scores, steps = [pool.score(probe, 2, RAW)], []
        for _ in range(2):
            steps.append(pool.train_step(groups).metrics)
            scores.append(pool.score(probe, 2, RAW))
    finally:
        pool.shutdown()
    assert [m["policy_frozen"] for m in steps] == [1.0, 0.0]
    assert [m["updates"] for m in steps] == [0.0, 8.0]  # 2 epochs x 4 single-sequence mini-batches
    assert np.array_equal(scores[0], scores[1]) and np.abs(scores[2] - scores[1]).max() > 1e-4
    # The second epoch starts again at mini-batch 0, against the pi_old of before the first update.
    assert steps[1]["approx_kl_mb0"] == pytest.approx(0.0, abs=1e-9) and steps[1]["approx_kl_mb4"] > 1e-4
    # Eight value steps per rollout batch (one per update, also while the policy waits) on fixed targets:
    # the mean value loss of the second step is well below the first's (measured 0.08 -> 0.002).
    assert steps[1]["critic_value_loss"] < 0.5 * steps[0]["critic_value_loss"]


def test_mismatch_per_lag_adds_up_to_the_batch_figures_on_one_and_two_ranks(pools):
    """Per-lag figures are token sums divided once, after merging micro-batches and ranks: weighted by their
    token counts they give back the batch's figure (a token mean), on one rank and on two ranks with
    micro-batches of at most 12 padded tokens (the pools' weights differ by now; each is checked alone)."""
    groups = make_groups(seed=5)
    lags = [i % 3 for i in range(sum(len(g.trajectories) for g in groups))]  # 12 samples, 4 per lag 0, 1, 2
    for pool in pools:
        m = pool.train_step(groups, lags=lags).metrics
        assert {k.split("/lag=")[1] for k in m if "/lag=" in k} == {"0", "1", "2"}
        assert not any(k.startswith("lagpart/") for k in m)
        tokens = {lag: m[f"mismatch_tokens/lag={lag}"] for lag in "012"}
        assert all(n > 0 for n in tokens.values())
        for figure in ("k3_kl", "kl", "logprob_abs_diff_mean"):
            weighted = sum(tokens[lag] * m[f"mismatch_{figure}/lag={lag}"] for lag in tokens) / sum(tokens.values())
            assert weighted == pytest.approx(m[f"mismatch_{figure}"], rel=1e-5, abs=1e-9), figure
        assert max(m[f"mismatch_logprob_abs_diff_max/lag={lag}"] for lag in tokens) == pytest.approx(m["mismatch_logprob_abs_diff_max"])
        assert m["time_forward_backward_s"] > 0 and m["time_optimizer_s"] > 0


def test_two_ranks_hold_half_the_train_state_of_one_within_a_budget_one_rank_exceeds(pools, tiny_model_dir):
    """`learner.rank_memory_gb`: one rank of the tiny model needs 3.97 MB of fp32 parameters, gradients and AdamW
    moments, over the pools' 3 MB budget, and is refused before anything starts; the two-rank pool runs under it,
    each rank holding (measured on the rank: its DTensor shards) half of what the single rank holds."""
    from asyncrl.learner.memory import parameter_shapes, rank_need
    from asyncrl.learner.pool import LearnerPool

    with pytest.raises(ValueError, match=r"rank_memory_gb = 0.003 is too small .*learner.num_ranks = 1: each rank needs 0.00397 GB.* fits from learner.num_ranks = 2"):
        LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=1, rank_memory_gb=BUDGET_GB), RECIPE)
    one, two = pools
    (single,), ranks = one.memory(), two.memory()
    need = rank_need(parameter_shapes(str(tiny_model_dir)), 2)
    held = [r["param_bytes"] + r["optimizer_bytes"] for r in ranks]
    whole = single["param_bytes"] + single["optimizer_bytes"]
    print(f"train state held per rank: one rank {whole:,} B; two ranks {held} B (ratios {[round(h / whole, 4) for h in held]}); "
          f"RSS one rank {single['rss_bytes'] / 1e6:.0f} MB, two ranks {[round(r['rss_bytes'] / 1e6) for r in ranks]} MB")
    assert whole == 247_872 * 12 + 4 * 50  # fp32 weights and two moments, AdamW's step counters
    assert all(0.4 <= h / whole <= 0.6 for h in held)
    assert sum(held) == whole + 4 * 50  # the shards add up to the whole; each rank keeps its own step counters
    assert ranks[0]["param_bytes"] == need.params and ranks[0]["grad_bytes"] == 0  # between steps: no gradients
    assert all(h + r["param_bytes"] <= BUDGET_GB * 1e9 for h, r in zip(held, ranks))  # with their gradients too


def test_a_wrapped_rank_trains_scores_exports_and_checkpoints_like_the_plain_one(pools, tiny_model_dir, tmp_path):
    """`learner.fsdp: always` on one rank: from the plain rank's checkpoint it takes the same step, scores the
    parity probe the same, publishes the same weights, and its checkpoint restores into two ranks."""
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.weights.buckets import unpack_bucket

    one, two = pools
    wrapped = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=1, fsdp="always", lr=1e-2), RECIPE)
    try:
        one.save_checkpoint(tmp_path / "plain", 3)
        assert wrapped.load_checkpoint(tmp_path / "plain").version == 3
        saved = one.state_snapshot()
        loaded = wrapped.state_snapshot()
        assert max_abs_diff(saved["params"], loaded["params"]) == max_abs_diff(saved["optimizer"], loaded["optimizer"]) == 0.0
        groups = make_groups(seed=9)
        stats_plain, stats_wrapped = one.train_step(groups), wrapped.train_step(groups)
        assert stats_wrapped.loss == pytest.approx(stats_plain.loss, abs=1e-7)
        assert stats_wrapped.grad_norm == pytest.approx(stats_plain.grad_norm, rel=1e-6)
        params = wrapped.state_snapshot()["params"]
        assert max_abs_diff(params, one.state_snapshot()["params"]) < 1e-6
        probe = [1, 5, 6, 7, 4, 9, 12, 3, 2]
        assert np.abs(wrapped.score(probe, 3, RAW) - one.score(probe, 3, RAW)).max() < 1e-7
        published = {k: v for ref in wrapped.export_weights(1 << 16).refs for k, v in unpack_bucket(ray_get(ref)).items()}
        assert len(published) == 51 and all(np.array_equal(published[k].numpy(), v) for k, v in params.items())
        wrapped.save_checkpoint(tmp_path / "wrapped", 4)
        two.load_checkpoint(tmp_path / "wrapped")
        restored = two.state_snapshot()
        assert max_abs_diff(params, restored["params"]) == 0.0
        assert max_abs_diff(wrapped.state_snapshot()["optimizer"], restored["optimizer"]) == 0.0
    finally:
        wrapped.shutdown()


def ray_get(ref):
    import ray

    return ray.get(ref)
