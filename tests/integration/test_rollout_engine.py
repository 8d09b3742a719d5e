"""The vLLM engine wrapper against a transformers fp32 forward pass of the same weights (invariants 1, 4).

One real vLLM CPU engine (tiny 0.3M model, tied embeddings) for the whole module, driven in-process on one
event loop. The reference log-probs divide the logits by the sampling temperature and apply top-p exactly as
the engine's sampler does, so agreement to 1e-5 proves the engine reports processed log-probs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from tests.conftest import module_engine
import torch

pytestmark = pytest.mark.integration

PARITY_ATOL = 1e-5
PROMPTS = [[1, 4 + i % 10, 4 + (3 * i) % 10, 14, 4 + (7 * i) % 10, 15] for i in range(8)]  # "a b + c ="-like


MARKER = "ASYNCRL_TEST_SET_AFTER_THE_SERVER"


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir):
    """Updated through vLLM's reload (`rollout.weight_load: reload`); the in-place load, what `auto` picks for
    this narrow model, is covered by test_weight_sync_shm.py and every W1 run. Started after the engine-core
    server, with a variable the server's environment lacks (`test_the_engine_core_is_forked_...`)."""
    import os

    from asyncrl.rollout import vllm_compat

    vllm_compat.start_engine_core_server()
    os.environ[MARKER] = "1"
    os.environ["ASYNCRL_PROCESS_INFO_ENV"] = f"{MARKER},OMP_NUM_THREADS"
    try:
        engine = module_engine(loop, tiny_model_dir, max_model_len=512, weight_load="reload")
    finally:
        del os.environ[MARKER], os.environ["ASYNCRL_PROCESS_INFO_ENV"]
    assert engine.weight_load == "reload"
    yield engine
    loop.run_until_complete(engine.shutdown())


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The learner's view: the same checkpoint in transformers, fp32. Tests that perturb it update the engine too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    return model


def reference_logprobs(model, prompt_ids, response_ids, temperature=1.0, top_p=1.0) -> np.ndarray:
    """log mu(response token t) with mu = top-p(softmax(logits / temperature)), as vLLM's sampler builds it."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature  # [T, V]
    if top_p < 1.0:
        # vLLM: sort ascending, drop the tokens whose cumulative probability stays within 1 - top_p,
        # always keep the most likely one.
        sorted_logits, order = logits.sort(dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, torch.tensor(response_ids).long()[:, None])[:, 0].numpy()


def _request(i: int, prompt_ids, tag: str):
    from asyncrl.testing import make_prompt, make_request

    return make_request(make_prompt(f"{tag}{i}", prompt_ids, "12"))


def _generate_all(loop, engine, spec, tag):
    async def all_prompts():
        return await asyncio.gather(*(engine.generate(_request(i, p, tag), spec) for i, p in enumerate(PROMPTS)))

    return loop.run_until_complete(all_prompts())


def _max_parity_error(model, trajectories, temperature, top_p=1.0) -> float:
    worst = 0.0
    for t in trajectories:
        assert len(t.response_ids) > 0
        ref = reference_logprobs(model, t.prompt_ids, t.response_ids, temperature, top_p)
        worst = max(worst, float(np.abs(ref - t.rollout_logprobs).max()))
    return worst


def _perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied: embed_tokens and lm_head are one parameter here
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_rollout_logprobs_are_the_processed_distribution_at_temperature_0_7(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec

    trajectories = _generate_all(loop, engine, SamplingSpec(max_tokens=24, temperature=0.7, ignore_eos=True), "t")
    worst = _max_parity_error(hf_model, trajectories, temperature=0.7)
    print(f"parity T=0.7 before update: max |diff| = {worst:.2e}")
    assert worst < PARITY_ATOL
    # The same tokens under temperature 1 differ by far more than the tolerance: the test can fail.
    t = trajectories[0]
    assert np.abs(reference_logprobs(hf_model, t.prompt_ids, t.response_ids, 1.0) - t.rollout_logprobs).max() > 1e-2
    for t in trajectories:
        assert t.finish_reason == "length" and t.failure is None
        assert len(t.rollout_logprobs) == len(t.loss_mask) == len(t.versions) == 24
        assert t.loss_mask.tolist() == [1] * 24 and t.versions.tolist() == [0] * 24
        assert t.worker == "engine-0" and t.group_id.startswith("t") and t.finished_at >= t.submitted_at


def test_outputs_delivered_in_batches_carry_the_same_tokens_logprobs_and_versions(loop, engine):
    """The default spec reports a running request's tokens every 16 (first and last always); the same seeded
    requests reported token by token must come back identical, token for token."""
    import dataclasses

    from asyncrl.rollout.engine import SamplingSpec

    batched = SamplingSpec(max_tokens=40, ignore_eos=True)
    assert batched.stream_interval == 16

    def run(spec, tag):
        async def all_prompts():
            jobs = (engine.generate(_request(i, p, tag), dataclasses.replace(spec, seed=100 + i)) for i, p in enumerate(PROMPTS))
            return await asyncio.gather(*jobs)

        return loop.run_until_complete(all_prompts())

    per_token = run(dataclasses.replace(batched, stream_interval=1), "each")
    in_batches = run(batched, "batch")
    for a, b in zip(per_token, in_batches):
        assert len(a.response_ids) == 40 and a.failure is None and b.failure is None
        assert a.response_ids.tolist() == b.response_ids.tolist()
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-6, rtol=0)
        assert a.versions.tolist() == b.versions.tolist() == [engine.version] * 40
    assert len({tuple(t.response_ids.tolist()) for t in in_batches}) > 1  # seeds differ per request: a real check


def test_rollout_logprobs_apply_top_p(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec

    trajectories = _generate_all(loop, engine, SamplingSpec(max_tokens=24, temperature=0.8, top_p=0.7, ignore_eos=True), "p")
    worst = _max_parity_error(hf_model, trajectories, temperature=0.8, top_p=0.7)
    print(f"parity T=0.8 top_p=0.7: max |diff| = {worst:.2e}")
    assert worst < PARITY_ATOL


def test_score_matches_transformers(loop, engine, hf_model):
    token_ids = [1, 5, 6, 14, 7, 8, 15, 9, 4, 2, 5, 5, 13]
    scored = loop.run_until_complete(engine.score(token_ids, prompt_len=4))
    ref = reference_logprobs(hf_model, token_ids[:4], token_ids[4:])
    print(f"score parity: max |diff| = {np.abs(ref - scored).max():.2e}")
    assert scored.shape == (len(token_ids) - 4,)
    np.testing.assert_allclose(scored, ref, atol=PARITY_ATOL, rtol=0)


def test_in_flight_update_keeps_running_requests_and_labels_later_tokens_with_the_new_version(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    _perturb(hf_model, scale=0.05, seed=1)
    buckets = pack_buckets(hf_named_tensors(hf_model), bucket_bytes=1 << 16)  # several buckets
    assert len(buckets) > 1

    async def scenario():
        long_request = _request(0, PROMPTS[0], "long")
        task = asyncio.ensure_future(engine.generate(long_request, SamplingSpec(max_tokens=400, ignore_eos=True, stream_interval=1)))
        while engine.progress("long0/0/0") < 20:
            await asyncio.sleep(0.005)
        tokens_before = engine.progress("long0/0/0")
        num_tensors = await engine.update_weights(buckets, version=1, in_flight=True)
        tokens_after = engine.progress("long0/0/0")
        return await task, tokens_before, tokens_after, num_tensors

    long, before, after, num_tensors = loop.run_until_complete(scenario())
    assert num_tensors == len(list(hf_named_tensors(hf_model)))  # lm_head.weight travelled explicitly
    assert engine.version == 1
    assert long.finish_reason == "length" and len(long.versions) == 400 and long.failure is None
    boundary = int(np.argmax(long.versions == 1))
    print(f"long request: {boundary} tokens at version 0, {400 - boundary} at version 1 (update between {before} and {after})")
    assert 0 < boundary < 400
    assert long.versions[:boundary].tolist() == [0] * boundary
    assert long.versions[boundary:].tolist() == [1] * (400 - boundary)
    assert before <= boundary <= after  # the switch happened while update_weights ran
    assert long.dispatch_version == 0 and long.min_version == 0 and long.max_version == 1

    # Parity holds again after the sync (fresh requests, new weights, tied head included).
    trajectories = _generate_all(loop, engine, SamplingSpec(max_tokens=24, temperature=0.7, ignore_eos=True), "u")
    worst = _max_parity_error(hf_model, trajectories, temperature=0.7)
    print(f"parity T=0.7 after in-flight update: max |diff| = {worst:.2e}")
    assert worst < PARITY_ATOL
    assert all(t.versions.tolist() == [1] * 24 for t in trajectories)
    token_ids = [1, 5, 6, 14, 7, 8, 15, 9, 4, 2]
    np.testing.assert_allclose(
        loop.run_until_complete(engine.score(token_ids, 3)), reference_logprobs(hf_model, token_ids[:3], token_ids[3:]), atol=PARITY_ATOL, rtol=0
    )


def test_blocking_update_lets_running_requests_finish_on_the_old_version(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    _perturb(hf_model, scale=0.05, seed=2)
    buckets = pack_buckets(hf_named_tensors(hf_model), bucket_bytes=1 << 30)

    async def scenario():
        task = asyncio.ensure_future(engine.generate(_request(0, PROMPTS[1], "drain"), SamplingSpec(max_tokens=200, ignore_eos=True, stream_interval=1)))
        while engine.progress("drain0/0/0") < 10:
            await asyncio.sleep(0.005)
        await engine.update_weights(buckets, version=2, in_flight=False)
        assert task.done()  # drained before the load
        return task.result()

    drained = loop.run_until_complete(scenario())
    assert drained.versions.tolist() == [1] * 200
    trajectories = _generate_all(loop, engine, SamplingSpec(max_tokens=16, temperature=0.7, ignore_eos=True), "w")
    assert _max_parity_error(hf_model, trajectories, temperature=0.7) < PARITY_ATOL
    assert all(set(t.versions.tolist()) == {2} for t in trajectories)


def test_abort_stale_ends_only_the_requests_certain_to_exceed_the_bound(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    buckets = pack_buckets(hf_named_tensors(hf_model), bucket_bytes=1 << 30)  # the weights it serves already
    v0 = engine.version
    spec = SamplingSpec(max_tokens=400, ignore_eos=True)

    async def scenario():
        old = asyncio.ensure_future(engine.generate(_request(0, PROMPTS[3], "old"), spec))
        while engine.progress("old0/0/0") < 5:
            await asyncio.sleep(0.005)
        await engine.update_weights(buckets, version=v0 + 1, in_flight=True)
        new = asyncio.ensure_future(engine.generate(_request(0, PROMPTS[4], "new"), spec))
        # A later turn of an episode whose first turn was sampled at v0: judged by that oldest model token.
        turn = dataclasses.replace(_request(0, PROMPTS[5], "turn"), context_min_version=v0)
        later = asyncio.ensure_future(engine.generate(turn, spec))
        while engine.progress("new0/0/0") < 5 or engine.progress("turn0/0/0") < 5:
            await asyncio.sleep(0.005)
        await engine.update_weights(buckets, version=v0 + 2, in_flight=True)
        # old: first token at v0, lag >= 2 at any later consumption; new: first token at v0 + 1, lag may be 1.
        aborted = await engine.abort_stale(abort_after_lag=1)
        again = await engine.abort_stale(abort_after_lag=1)
        return await old, await new, await later, aborted, again

    old, new, later, aborted, again = loop.run_until_complete(scenario())
    assert (aborted, again) == (2, 0)
    # Its own tokens start at v0 + 1 (lag 1 alone), but the episode it continues holds tokens of v0.
    assert later.failure.startswith("stale:") and f"version {v0}," in later.failure and later.min_version == v0 + 1
    assert old.failure.startswith("stale:") and f"version {v0}," in old.failure and old.finish_reason == "abort"
    assert 5 <= len(old.response_ids) < 400 and len(old.versions) == len(old.rollout_logprobs) == len(old.response_ids)
    assert old.min_version == v0
    assert new.failure is None and new.finish_reason == "length" and len(new.response_ids) == 400
    assert new.min_version == v0 + 1 and new.max_version == v0 + 2


def test_a_request_past_its_timeout_is_aborted_and_comes_back_failed_timeout(loop, engine):
    from asyncrl.rollout.engine import SamplingSpec

    started = time.monotonic()
    # 480 tokens of one sequence take ~2 s on an idle 2-core machine; the request gets 0.5 s.
    t = loop.run_until_complete(engine.generate(_request(0, PROMPTS[2], "slow"), SamplingSpec(max_tokens=480, ignore_eos=True, timeout_s=0.5)))
    elapsed = time.monotonic() - started
    assert t.failure is not None and t.failure.startswith("timeout:")
    assert t.finish_reason == "abort"
    assert len(t.response_ids) < 480  # the partial response comes back
    assert len(t.rollout_logprobs) == len(t.versions) == len(t.response_ids)
    assert elapsed < 0.5 + 5.0  # abort is prompt (the grace period for the final output is 5 s)
    # The engine keeps serving.
    ok = loop.run_until_complete(engine.generate(_request(1, PROMPTS[2], "after"), SamplingSpec(max_tokens=4, ignore_eos=True)))
    assert ok.failure is None and len(ok.response_ids) == 4


def _group(i: int, prompt_ids, tag: str, size: int):
    from asyncrl.testing import make_prompt, make_request

    prompt = make_prompt(f"{tag}{i}", prompt_ids, "12")
    return [make_request(prompt, sample_index=k, group_size=size) for k in range(size)]


def test_a_group_started_together_is_one_vllm_request_and_each_member_keeps_its_own_tokens_and_logprobs(loop, engine, hf_model):
    from asyncrl.rollout.engine import SamplingSpec

    spec = SamplingSpec(max_tokens=12, temperature=0.7, ignore_eos=True)
    groups = [_group(i, p, "g", 4) for i, p in enumerate(PROMPTS[:3])]
    before = engine.num_vllm_requests

    async def run():
        return await asyncio.gather(*(engine.generate(r, spec) for group in groups for r in group))

    trajectories = loop.run_until_complete(run())
    assert engine.num_vllm_requests - before == 3  # one per group, not one per sample
    assert [(t.group_id, t.sample_index) for t in trajectories] == [(r.group_id, r.sample_index) for g in groups for r in g]
    for t in trajectories:
        assert t.failure is None and t.finish_reason == "length" and len(t.response_ids) == 12
        assert len(t.rollout_logprobs) == len(t.versions) == 12 and set(t.versions.tolist()) == {engine.version}
    assert _max_parity_error(hf_model, trajectories, temperature=0.7) < PARITY_ATOL
    for g in range(3):  # the members are independent samples, not one sample copied
        assert len({tuple(t.response_ids.tolist()) for t in trajectories[4 * g : 4 * g + 4]}) > 1
    # Seeded or greedy samples are not shared (vLLM refuses n > 1 when greedy): one vLLM request each.
    for tag, alone in (("seeded", SamplingSpec(max_tokens=4, ignore_eos=True, seed=7)), ("greedy", SamplingSpec(max_tokens=4, temperature=0.0))):
        before = engine.num_vllm_requests

        async def run_alone():
            return await asyncio.gather(*(engine.generate(r, alone) for r in _group(0, PROMPTS[0], tag, 2)))

        pair = loop.run_until_complete(run_alone())
        assert engine.num_vllm_requests - before == 2 and all(t.failure is None for t in pair), tag


def test_one_member_of_a_group_request_is_cancelled_alone_and_the_others_carry_an_in_flight_update(loop, engine, hf_model):
    """Member 1 of a 4-sample request is cancelled mid-generation: vLLM ends that sample only (its final
    "abort" output comes back), while the other three run to their full length across an in-flight weight
    update, each with its own version boundary."""
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    buckets = pack_buckets(hf_named_tensors(hf_model), bucket_bytes=1 << 30)  # the weights it serves already
    v0 = engine.version
    spec = SamplingSpec(max_tokens=300, ignore_eos=True, stream_interval=1)
    group = _group(0, PROMPTS[5], "c", 4)

    async def scenario():
        before = engine.num_vllm_requests
        tasks = [asyncio.ensure_future(engine.generate(r, spec)) for r in group]
        while min(engine.progress(r.request_id) for r in group) < 20:
            await asyncio.sleep(0.005)
        assert engine.num_vllm_requests - before == 1
        cancelled = engine._running[group[1].request_id]
        tasks[1].cancel()
        await engine.update_weights(buckets, version=v0 + 1, in_flight=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, cancelled

    results, cancelled = loop.run_until_complete(scenario())
    assert isinstance(results[1], asyncio.CancelledError)
    assert cancelled.finish_reason == "abort" and 20 <= len(cancelled.token_ids) < 300
    for t in (results[0], results[2], results[3]):
        assert t.failure is None and t.finish_reason == "length" and len(t.response_ids) == 300
        boundary = int(np.argmax(t.versions == v0 + 1))
        assert 20 <= boundary < 300
        assert t.versions.tolist() == [v0] * boundary + [v0 + 1] * (300 - boundary)
    assert not engine._llm.output_processor.request_states  # nothing left running in vLLM


def test_the_members_of_a_group_past_their_timeout_each_come_back_failed_timeout(loop, engine):
    from asyncrl.rollout.engine import SamplingSpec

    spec = SamplingSpec(max_tokens=480, ignore_eos=True, timeout_s=0.5)

    async def run():
        return await asyncio.gather(*(engine.generate(r, spec) for r in _group(0, PROMPTS[6], "slowg", 3)))

    started = time.monotonic()
    results = loop.run_until_complete(run())
    assert time.monotonic() - started < 0.5 + 5.0
    for t in results:
        assert t.failure is not None and t.failure.startswith("timeout:") and t.finish_reason == "abort"
        assert len(t.response_ids) < 480 and len(t.rollout_logprobs) == len(t.versions) == len(t.response_ids)
    assert not engine._llm.output_processor.request_states


def test_a_request_vllm_rejects_fails_each_member_engine_error_and_the_engine_keeps_serving(loop, engine):
    from asyncrl.rollout.engine import SamplingSpec

    too_long = [1] + [5] * 600  # the engine's context is 512 tokens
    spec = SamplingSpec(max_tokens=4, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(engine.generate(r, spec) for r in _group(0, too_long, "long", 2) + [_request(1, PROMPTS[0], "fine")]))

    *rejected, fine = loop.run_until_complete(run())
    for t in rejected:
        assert t.failure.startswith("engine_error: "), t.failure
        assert t.finish_reason == "error" and len(t.response_ids) == 0
    assert fine.failure is None and len(fine.response_ids) == 4


def test_evaluate_is_greedy_and_matches_transformers_argmax(loop, engine, hf_model):
    results = loop.run_until_complete(engine.evaluate(PROMPTS[:3], max_tokens=6))
    assert results == loop.run_until_complete(engine.evaluate(PROMPTS[:3], max_tokens=6))
    for prompt, (text, reason) in zip(PROMPTS[:3], ((r.texts[0], r.finish_reasons[0]) for r in results)):
        ids = list(prompt)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(nxt)
                out.append(nxt)
                if nxt == hf_model.config.eos_token_id:
                    break
        assert text == engine.decode(out)
        assert reason == ("stop" if out[-1] == hf_model.config.eos_token_id else "length")


def test_the_started_engine_keeps_its_startup_heap_out_of_full_collections(engine):
    """`Engine.start` freezes what is alive after its warm-up, as vLLM's own server does: a full collection then
    walks only what was made since. Before, a W1 rollout worker spent 8 s of CPU in 75 s on full collections of
    its ~650k start-up objects (benchmarks/RESULTS.md, client floor)."""
    import gc

    assert engine.frozen_objects > 100_000  # torch, transformers and vLLM
    assert len(gc.get_objects(generation=2)) < engine.frozen_objects / 2  # the frozen ones are not in the oldest generation


def test_the_engine_core_is_forked_from_the_preloaded_server_with_this_process_environment(loop, engine):
    """vLLM spawns its engine core (a fresh interpreter importing vLLM again, ~8 s here); asyncrl forks it from a
    server that imported vLLM beside this process (`vllm_compat.start_engine_core_server`). The child must still
    run as a spawned one would: this process's environment at engine start, not the server's (the marker was set
    after the server started), its torch threads from OMP_NUM_THREADS or, unset, this process's count, and vLLM's
    process title."""
    import multiprocessing.forkserver
    import os

    from asyncrl.rollout import vllm_compat

    server = multiprocessing.forkserver._forkserver._forkserver_pid
    info = loop.run_until_complete(engine._llm.collective_rpc(vllm_compat.PROCESS_INFO_RPC))[0]
    assert info["ppid"] == server != os.getpid()
    with open(f"/proc/{server}/environ", "rb") as f:
        assert MARKER.encode() not in f.read()  # so the core's copy came from this process at engine start
    assert info["env"] == {MARKER: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    assert info["torch_threads"] == vllm_compat.process._engine_threads(os.environ) > 0
    with open(f"/proc/{info['pid']}/comm") as f:
        assert f.read().strip() == "VLLM::EngineCor"  # vLLM's process title, which `ps` and py-spy users look for
