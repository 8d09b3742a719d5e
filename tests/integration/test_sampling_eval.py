"""Truncated sampling and evaluation against a real vLLM CPU engine and a real learner rank, and the
pass-rate curriculum in a real run.

One engine (in-process, tiny 0.3M model with a 16-token vocab) and one FSDP2 learner rank on the same
weights serve the sampling and evaluation tests. Under temperature 0.9, top-k 5 and top-p 0.8 the
learner's log-probs (`asyncrl.algo.sampling`) must equal what vLLM reports, token by token.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import module_engine

from asyncrl.algo.sampling import SamplingDistribution, logprob_gap

pytestmark = pytest.mark.integration

# The run's reward `sandbox_rewards:even_index_passes` is imported by name in the sandboxed reward processes,
# which inherit the environment of the Ray cluster the `ray_cluster` fixture starts after collection. It lives
# in a module that imports nothing heavy: each reward call is a fresh process that imports it.
_ROOT = Path(__file__).resolve().parents[2]
_WORKER_PATH = (str(_ROOT / "tests/unit/envs"), str(_ROOT), os.environ.get("PYTHONPATH"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in _WORKER_PATH if p)

TEMPERATURE, TOP_P, TOP_K = 0.9, 0.8, 5
PARITY_ATOL = 1e-4
PROMPTS = [[1, 4 + i % 10, 4 + (3 * i) % 10, 14, 4 + (7 * i) % 10, 15] for i in range(8)]


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir):
    engine = module_engine(loop, tiny_model_dir, max_model_len=256)
    yield engine
    loop.run_until_complete(engine.shutdown())


@pytest.fixture(scope="module")
def learner(ray_cluster, tiny_model_dir):
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.pool import LearnerPool

    sampling = SamplingDistribution(TEMPERATURE, TOP_P, TOP_K)
    pool = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=1, tokens_per_microbatch=4096), resolve_recipe("grpo"), sampling)
    yield pool
    pool.shutdown()


def _spec(**kw):
    from asyncrl.rollout.engine import SamplingSpec

    return SamplingSpec(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, **kw)


def test_learner_logprobs_of_sampled_tokens_equal_the_engines_under_top_k_and_top_p(loop, engine, learner):
    from asyncrl.testing import make_prompt, make_request

    async def generate_all():
        requests = [make_request(make_prompt(f"p{i}", p, "12")) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(engine.generate(r, _spec(max_tokens=16, ignore_eos=True, seed=i)) for i, r in enumerate(requests)))

    trajectories = loop.run_until_complete(generate_all())
    worst = 0.0
    for t in trajectories:
        ids = t.prompt_ids.tolist() + t.response_ids.tolist()
        scored = learner.score(ids, len(t.prompt_ids))
        assert np.isfinite(t.rollout_logprobs).all() and np.isfinite(scored).all()  # sampled tokens are in the kept set
        worst = max(worst, logprob_gap(t.rollout_logprobs, scored))
    print(f"sampled tokens, T={TEMPERATURE} top_k={TOP_K} top_p={TOP_P}: max |engine - learner| = {worst:.2e}")
    assert worst <= PARITY_ATOL
    # Truncation is really on: the processed log-probs are larger than the raw ones (mass renormalised).
    raw = learner.score(ids, len(t.prompt_ids), SamplingDistribution())
    assert (scored > raw + 1e-3).any()


def test_engine_score_under_the_run_sampling_equals_the_learner_and_agrees_on_the_kept_set(loop, engine, learner):
    # A sequence of arbitrary tokens: with 5 of 16 tokens kept at most, several fall outside the kept set.
    ids = [1, 5, 6, 14, 7, 8, 15, 9, 4, 2, 5, 5, 13, 11, 3, 10, 12]
    engine_logprobs = loop.run_until_complete(engine.score(ids, 4, _spec()))
    learner_logprobs = learner.score(ids, 4)
    outside = np.isneginf(engine_logprobs)
    print("outside the kept set:", outside.astype(int).tolist(), "engine:", engine_logprobs.round(4).tolist())
    assert outside.any() and not outside.all()
    assert np.array_equal(outside, np.isneginf(learner_logprobs))
    assert logprob_gap(engine_logprobs, learner_logprobs) <= PARITY_ATOL
    # Without `sampling` the engine scores the raw distribution, which the learner gives with SamplingDistribution().
    assert logprob_gap(loop.run_until_complete(engine.score(ids, 4)), learner.score(ids, 4, SamplingDistribution())) <= PARITY_ATOL


def test_greedy_evaluation_is_one_completion_per_prompt_under_the_served_version(loop, engine):
    results = loop.run_until_complete(engine.evaluate(PROMPTS[:4], max_tokens=6))
    assert [len(r.texts) for r in results] == [1, 1, 1, 1]
    assert all(r.versions == {engine.version} for r in results)
    assert results == loop.run_until_complete(engine.evaluate(PROMPTS[:4], max_tokens=6))  # greedy: repeatable


def test_sampled_evaluation_gives_k_completions_per_prompt(loop, engine):
    results = loop.run_until_complete(engine.evaluate(PROMPTS[:4], max_tokens=6, temperature=1.0, samples=4))
    assert [len(r.texts) for r in results] == [4, 4, 4, 4] and all(len(r.finish_reasons) == 4 for r in results)
    assert len({text for r in results for text in r.texts}) > 4  # sampled, not four copies of greedy
    greedy = loop.run_until_complete(engine.evaluate(PROMPTS[:2], max_tokens=6, samples=3))  # vLLM takes no n > 1 here
    assert [r.texts for r in greedy] == [r.texts * 3 for r in loop.run_until_complete(engine.evaluate(PROMPTS[:2], max_tokens=6))]


def test_an_evaluation_across_a_weight_update_reports_both_versions(loop, engine, learner):
    import ray

    buckets = ray.get(learner.export_weights(1 << 20).refs)  # the same weights, relabelled as version 1
    before = engine.version

    async def evaluate_across_an_update():
        task = asyncio.ensure_future(engine.evaluate(PROMPTS, max_tokens=64, temperature=1.0, samples=2))
        await asyncio.sleep(0.05)  # every request is submitted under `before`; most are still running
        await engine.update_weights(buckets, before + 1, in_flight=True)
        return await task

    results = loop.run_until_complete(evaluate_across_an_update())
    print("versions per prompt:", [sorted(r.versions) for r in results])
    assert any(r.versions == {before, before + 1} for r in results)
    assert all(r.versions <= {before, before + 1} for r in results)
    after = loop.run_until_complete(engine.evaluate(PROMPTS[:2], max_tokens=6))
    assert all(r.versions == {before + 1} for r in after)


def test_a_step_takes_tokens_outside_the_learner_kept_set_out_of_the_loss(learner):
    """Last in the module: it moves the learner's weights. Random responses of a 16-token vocab fall
    outside the top-5 often; the step stays finite and reports the fraction it left out."""
    from asyncrl.testing import random_groups

    groups = random_groups(num_groups=2, group_size=3, seed=3)
    outside = total = 0
    for t in (t for g in groups for t in g.trajectories):
        scored = learner.score(t.prompt_ids.tolist() + t.response_ids.tolist(), len(t.prompt_ids))
        mask = t.loss_mask.astype(bool)
        outside, total = outside + int((np.isneginf(scored) & mask).sum()), total + int(mask.sum())
    stats = learner.train_step(groups)
    print(f"outside the kept set: {outside}/{total} loss tokens; step metrics {stats.metrics['outside_support_frac']:.4f}")
    assert 0 < outside < total
    assert stats.metrics["outside_support_frac"] == pytest.approx(outside / total)
    assert np.isfinite(stats.loss) and np.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert stats.metrics["skipped_step"] == 0.0


def test_a_run_retires_prompts_it_solves_and_keeps_sampling_the_others(ray_cluster, tiny_model_dir, tmp_path):
    """ScaleRL no-positive-resampling over several epochs of an 8-prompt Parquet dataset: the even prompts
    always pass, so each is retired after its first group and skipped when its id comes round again. The
    run samples with top-k and top-p, so its parity probe compares the processed distributions too."""
    _write_dataset(tmp_path / "train.parquet")
    overrides = {
        "mode": "sync", "buffer.max_staleness": 0, "output_dir": str(tmp_path / "run"), "model.path": str(tiny_model_dir),
        "data.task": "parquet", "data.train_path": str(tmp_path / "train.parquet"), "env.reward": "sandbox_rewards:even_index_passes", "env.reward_timeout_s": 60,
        "buffer.pass_rate_curriculum": True, "learner.max_steps": 5, "rollout.max_tokens": 4, "telemetry.progress": False,
        "checkpoint.export_hf": False, "rollout.temperature": TEMPERATURE, "rollout.top_p": TOP_P, "rollout.top_k": TOP_K,
    }  # fmt: skip
    summary, _ = _run(overrides, tiny_model_dir)
    import pyarrow.parquet as pq

    log = pq.read_table(tmp_path / "run" / "trajectories.parquet", columns=["prompt_id", "group_id"]).to_pylist()
    groups_of: dict[str, set[str]] = {}
    for row in log:
        groups_of.setdefault(row["prompt_id"], set()).add(row["group_id"])
    print("groups per prompt:", {p: len(g) for p, g in sorted(groups_of.items())}, "counters:", summary["counters"])
    # 5 steps x 4 groups = 20 groups: the first epoch's 8 (sync mode: all finish before the next batch is
    # admitted), then only odd prompts: 12 more, so each odd prompt 1 + 3 = 4 groups and each even one 1.
    assert all(len(groups_of[str(i)]) == 1 for i in (0, 2, 4, 6))
    assert all(len(groups_of[str(i)]) == 4 for i in (1, 3, 5, 7))
    assert summary["counters"]["retired_prompts"] == 4
    assert summary["counters"]["skipped_retired"] >= 4  # each even id came round at least once more
    assert summary["parity_max_abs_diff_mean"] is not None and summary["parity_max_abs_diff_mean"] <= PARITY_ATOL


def test_a_run_with_a_kl_to_the_starting_weights_reports_it_from_zero(ray_cluster, tiny_model_dir, tmp_path):
    """`kl_coef` > 0 and KL in the reward (`kl_in_reward_coef`, GAE with a critic) with the default reference (the
    starting weights) under top-k / top-p: at step 1 the policy is the reference, so `kl_ref` (k3) is 0; rewards that
    differ within groups move the policy, so it grows after."""
    _write_dataset(tmp_path / "train.parquet")
    overrides = {
        "mode": "sync", "buffer.max_staleness": 0, "output_dir": str(tmp_path / "run"), "model.path": str(tiny_model_dir),
        "data.task": "parquet", "data.train_path": str(tmp_path / "train.parquet"), "env.reward": "sandbox_rewards:varied", "env.reward_timeout_s": 60,
        "learner.max_steps": 3, "learner.lr": 0.01, "rollout.max_tokens": 4, "telemetry.progress": False, "checkpoint.export_hf": False,
        "rollout.temperature": TEMPERATURE, "rollout.top_p": TOP_P, "rollout.top_k": TOP_K, "algorithm.preset": "ppo_gae",
        "learner.critic": True, "algorithm.params": {"kl_coef": 0.1, "kl_in_reward_coef": 0.1},
    }  # fmt: skip
    summary, history = _run(overrides, tiny_model_dir)
    kl_ref = [row["kl_ref"] for row in history]
    print("kl_ref per step:", kl_ref, "kl_loss:", [row["kl_loss"] for row in history])
    assert summary["steps"] == 3 and len(kl_ref) == 3
    assert abs(kl_ref[0]) <= 1e-6 and abs(history[0]["kl_loss"]) <= 1e-6
    assert all(k >= 0 for k in kl_ref) and kl_ref[2] > 0


def _write_dataset(path: Path) -> None:
    """8 prompts `i+i=`; the reward `even_index_passes` passes the even ones whatever the answer."""
    from asyncrl.envs.data import write_verl_parquet

    rows = [
        {"data_source": "tiny", "prompt": [{"role": "user", "content": f"{i}+{i}="}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
        for i in range(8)
    ]  # fmt: skip
    write_verl_parquet(rows, path)


def _run(overrides: dict, model_dir) -> tuple[dict, list[dict]]:
    """A real run of TINY_RUN plus `overrides` -> (summary, step rows)."""
    from asyncrl.config import load_config
    from asyncrl.controller.loop import Controller
    from asyncrl.testing import TINY_RUN

    cfg = load_config(None, [*TINY_RUN, *(f"{k}={json.dumps(v)}" for k, v in overrides.items())])
    controller = Controller(cfg, model_dir)
    try:
        controller.start()
        return controller.run(), controller.records.history
    finally:
        controller.shutdown()
