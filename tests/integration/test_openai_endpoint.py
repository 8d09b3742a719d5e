"""The OpenAI-compatible endpoint of a rollout worker, through the real `openai` client and a real vLLM CPU engine.

One engine for the module: the `ascii-1m` preset (random init, char tokenizer: one token per character), sampling
at the rollout temperature. A random model does not write tool calls, so the round trip here sends tools and tool
results through the template around whatever it samples; the parse-and-echo of a sampled `<tool_call>` is checked
token by token on scripted completions in tests/unit/rollout/test_openai_capture.py.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
QUESTION = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "5"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncrl.models import build_model

    return build_model("ascii-1m", tmp_path_factory.mktemp("ascii-model"), seed=0)


@pytest.fixture(scope="module")
def worker(loop, model_dir):
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.worker import RolloutWorker, WorkerSpec

    rollout = RolloutConfig(openai_port=-1, openai_chat_template="qwen2_tools", max_tokens=6, max_model_len=1024, max_requests_in_flight=8)
    worker = RolloutWorker("rollout-0", WorkerSpec(str(model_dir), rollout=rollout, max_model_len=1024))
    loop.run_until_complete(worker.ready())
    yield worker
    loop.run_until_complete(worker.shutdown())


def client(url: str, episode: str | None = None):
    import openai

    headers = {"X-Episode-Id": episode} if episode else None
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers=headers)


def same_weights(model_dir) -> list[bytes]:
    from transformers import AutoModelForCausalLM

    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    return pack_buckets(hf_named_tensors(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)), bucket_bytes=1 << 30)


def test_multi_call_episode_is_one_trajectory_of_exactly_what_the_engine_produced(loop, worker, model_dir):
    url = worker.openai.url
    buckets = same_weights(model_dir)

    async def episode():
        c, messages, replies = client(url, "ep-1"), [{"role": "user", "content": "Hello"}], []
        for k in range(3):
            raw = await c.chat.completions.with_raw_response.create(model="m", messages=messages, logprobs=True, max_tokens=4 + k)
            replies.append((raw.headers["x-policy-version"], raw.parse()))
            messages += [{"role": "assistant", "content": replies[-1][1].choices[0].message.content}, {"role": "user", "content": f"more {k}"}]
            if k == 0:
                await worker.update_weights(buckets, version=1)  # the same weights, relabelled: later tokens carry 1
        return replies, await worker.finish_episode("ep-1", reward=1.0)

    replies, t = loop.run_until_complete(episode())
    assert [h for h, _ in replies] == ["0", "1", "1"]
    assert t.prompt_ids.tolist() == replies[0][1].prompt_token_ids
    assert len(t.turn_starts) == 3 and t.turn_starts[0] == 0
    expected_mask = np.zeros(len(t.response_ids), dtype=np.int8)
    for k, (_, r) in enumerate(replies):
        start, ids = t.turn_starts[k], r.choices[0].token_ids
        # Each call was fed exactly the episode so far, and its sampled tokens and log-probs are the trajectory's.
        assert r.prompt_token_ids == t.prompt_ids.tolist() + t.response_ids[:start].tolist()
        assert t.response_ids[start : start + len(ids)].tolist() == ids
        assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(r.prompt_token_ids)
        logprobs = np.asarray([c.logprob for c in r.choices[0].logprobs.content], dtype=np.float32)
        assert np.array_equal(t.rollout_logprobs[start : start + len(ids)], logprobs)
        assert np.all(logprobs < 0)
        expected_mask[start : start + len(ids)] = 1
        assert set(t.versions[start : start + len(ids)].tolist()) == {0 if k == 0 else 1}
    assert t.loss_mask.tolist() == expected_mask.tolist()
    # The observation after the first turn is the template's text for the new user message, at version 0.
    first_end = t.turn_starts[0] + len(replies[0][1].choices[0].token_ids)
    observation = t.response_ids[first_end : t.turn_starts[1]]
    assert worker.openai.renderer.decode(observation).endswith("<|im_start|>user\nmore 0<|im_end|>\n<|im_start|>assistant\n")
    assert set(t.versions[first_end : t.turn_starts[1]].tolist()) == {0}
    assert t.reward == 1.0 and t.worker == "rollout-0" and worker.openai.capture.drifts == 0


@pytest.mark.parametrize("template", ["default", "chatml", "llama3", "gemma"])
def test_zero_drift_on_every_shipped_template_with_a_tool_call_round_trip(loop, worker, template):
    from transformers import AutoTokenizer

    from asyncrl.models.templates import load_chat_template
    from asyncrl.rollout.openai_capture import ChatRenderer
    from asyncrl.rollout.openai_server import OpenAIServer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(worker.spec.model_dir), load_chat_template(template))
    server = OpenAIServer(worker.engine, renderer, worker.sampling, 1024, "m")

    async def episode():
        c, messages = client(await server.start(), "tools"), list(QUESTION)
        for follow_up in (TOOL_RESULT, {"role": "user", "content": "thanks"}, None):
            r = await c.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=6)
            messages += [r.choices[0].message.model_dump(exclude_none=True)] + ([follow_up] if follow_up else [])
        captured = await server.finish_episode("tools")
        await server.stop()
        return captured

    captured = loop.run_until_complete(episode())
    assert captured.calls == 3 and captured.drifts == 0 and server.capture.drifts == 0
    t = captured.trajectory(prompt_id="p", group_id="g", sample_index=0)
    observation = renderer.decode(t.response_ids[t.loss_mask == 0].tolist())
    assert "5" in observation and "thanks" in observation  # the tool result and the user turn, as the template wrote them


def test_loopback_binding_bad_fields_and_unknown_episodes(loop, worker):
    import openai

    url = worker.openai.url
    assert url.startswith("http://127.0.0.1:")

    async def calls():
        c = client(url)
        models = await c.models.list()
        errors = {}
        for field, extra in (("temperature", {"temperature": 5}), ("n", {"n": 0}), ("top_logprobs", {"top_logprobs": 2})):
            try:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **extra)
            except openai.BadRequestError as e:
                errors[field] = (e.status_code, e.param)
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], user="fresh")
        return models, errors, await worker.finish_episode("fresh", reward=0.5)

    models, errors, t = loop.run_until_complete(calls())
    assert [m.id for m in models.data] == [worker.openai.model_name]
    assert errors == {"temperature": (400, "temperature"), "n": (400, "n"), "top_logprobs": (400, "top_logprobs")}
    assert t.turn_starts == [0] and t.loss_mask.sum() == len(t.response_ids) > 0 and t.reward == 0.5


def test_agent_env_returns_the_harness_episode_scored_by_the_harness(loop, worker):
    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    async def agent(c, prompt, episode):
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            r = await c.chat.completions.create(model=episode.model, messages=messages, max_tokens=3)
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "again"}]
        return float(episode.prompt.ground_truth == "7"), {"truncated": True}

    async def broken(c, prompt, episode):
        await c.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": prompt}], max_tokens=2)
        raise RuntimeError("harness bug")

    request = make_request(make_prompt("q7", text="What is 3+4?", ground_truth="7"), sample_index=2)
    good = loop.run_until_complete(OpenAIAgentEnv(agent, worker.openai, 60.0).rollout(request, "rollout-0"))
    bad = loop.run_until_complete(OpenAIAgentEnv(broken, worker.openai, 60.0).rollout(request, "rollout-0"))
    assert (good.group_id, good.sample_index, good.failure, good.truncated, len(good.turn_starts)) == (request.group_id, request.sample_index, None, True, 2)
    assert good.reward == 1.0 and good.prompt_id == "q7"
    assert bad.failure == "agent_error: RuntimeError: harness bug" and len(bad.turn_starts) == 1


def test_an_endpoint_with_an_api_key_serves_the_openai_client_that_sends_it_and_refuses_others(loop, worker):
    import openai

    from asyncrl.rollout.openai_server import OpenAIServer

    base = worker.openai
    keyed = OpenAIServer(base.engine, base.renderer, base.sampling, base.max_model_len, "keyed")
    url = loop.run_until_complete(keyed.start("127.0.0.1", 0, api_key="sk-run-key"))

    async def calls():
        good = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-run-key", max_retries=0)
        reply = await good.chat.completions.create(model="keyed", messages=[{"role": "user", "content": "x"}], max_tokens=3)
        refused = []
        for key in ("sk-wrong", ""):
            try:
                await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "unset", max_retries=0).models.list()
            except openai.AuthenticationError as e:
                refused.append((e.status_code, "missing or wrong token" in str(e)))
        return reply, refused

    async def one_call(c, prompt, episode):  # the agent harness's client sends the worker's key itself
        await c.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": prompt}], max_tokens=2)
        return 1.0

    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    try:
        reply, refused = loop.run_until_complete(calls())
        request = make_request(make_prompt("q1", text="1+1?", ground_truth="2"), sample_index=0)
        harnessed = loop.run_until_complete(OpenAIAgentEnv(one_call, keyed, 60.0).rollout(request, "rollout-0"))
    finally:
        loop.run_until_complete(keyed.stop())
    assert reply.choices[0].message.role == "assistant" and len(reply.choices[0].token_ids) >= 1
    assert refused == [(401, True), (401, True)]
    assert harnessed.failure is None and harnessed.reward == 1.0 and keyed.calls == 2


def _same_episode(a, b) -> bool:
    fields = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "versions")
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields) and a.turn_starts == b.turn_starts


def test_streamed_episode_equals_the_non_streamed_one_for_a_fixed_seed(loop, worker):
    url = worker.openai.url

    async def episode(name: str, stream: bool):
        c, messages, calls = client(url, name), [{"role": "user", "content": "Hi"}], []
        for k in range(2):
            kwargs = dict(model="m", messages=messages, max_tokens=5, seed=7 + k, logprobs=True)
            if not stream:
                r = await c.chat.completions.create(**kwargs)
                choice = r.choices[0]
                calls.append((choice.message.content, choice.token_ids, [e.logprob for e in choice.logprobs.content], r.usage.total_tokens))
            else:
                chunks = [ch async for ch in await c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})]
                assert {ch.object for ch in chunks} == {"chat.completion.chunk"} and chunks[0].choices[0].delta.role == "assistant"
                body = [ch.choices[0] for ch in chunks if ch.choices]
                text = "".join(ch.delta.content or "" for ch in body)
                logprobs = [e.logprob for ch in body if ch.logprobs for e in ch.logprobs.content]
                assert body[-1].finish_reason in ("stop", "length") and all(ch.finish_reason is None for ch in body[:-1])
                assert chunks[-1].choices == [] and chunks[-1].usage is not None
                calls.append((text, body[-1].token_ids, logprobs, chunks[-1].usage.total_tokens))
            messages += [{"role": "assistant", "content": calls[-1][0]}, {"role": "user", "content": f"next {k}"}]
        return calls, await worker.finish_episode(name, reward=1.0)

    plain_calls, plain = loop.run_until_complete(episode("plain", stream=False))
    streamed_calls, streamed = loop.run_until_complete(episode("streamed", stream=True))
    assert streamed_calls == plain_calls
    assert all(len(ids) == len(lps) > 0 for _, ids, lps, _ in plain_calls)  # one log-prob chunk per sampled token
    assert _same_episode(plain, streamed) and len(streamed.turn_starts) == 2 and worker.openai.capture.drifts == 0


def test_n_2_gives_two_choices_each_captured_as_its_own_branch(loop, worker):
    url = worker.openai.url
    messages = [{"role": "user", "content": "Pick"}]

    async def group():
        r = await client(url, "grp").chat.completions.create(model="m", messages=messages, n=2, max_tokens=4, seed=3)
        return r, await worker.finish_episode("grp", reward=1.0), await worker.finish_episode("grp#1", reward=0.0)

    r, first, second = loop.run_until_complete(group())
    assert [c.index for c in r.choices] == [0, 1] and [c.episode_id for c in r.choices] == ["grp", "grp#1"]
    for choice, t in zip(r.choices, (first, second), strict=True):
        assert t.prompt_ids.tolist() == r.prompt_token_ids and t.response_ids.tolist() == choice.token_ids
    assert r.usage.completion_tokens == len(r.choices[0].token_ids) + len(r.choices[1].token_ids)
    assert r.usage.prompt_tokens == len(r.prompt_token_ids) and (first.reward, second.reward) == (1.0, 0.0)


def test_a_streamed_call_sends_its_first_tokens_while_the_engine_is_still_sampling(loop, worker):
    url = worker.openai.url

    async def call():
        seen = []  # (content, tokens the engine had sampled for the call when the client read the chunk)
        stream = await client(url, "live").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Tell"}], max_tokens=100, seed=1, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen.append((chunk.choices[0].delta.content, sum(worker.engine.running().values())))
            if chunk.choices and chunk.choices[0].finish_reason:
                ids = chunk.choices[0].token_ids
        return seen, ids, await worker.finish_episode("live", reward=0.0)

    seen, ids, t = loop.run_until_complete(call())
    assert len(ids) >= 50, "seed 1 samples a long answer on this model"  # room for the stream to run ahead
    # The first pieces reached the client while the engine was still sampling the rest of this call.
    assert 0 < seen[0][1] < len(ids) and len(seen) > 1
    assert t.response_ids.tolist() == ids and worker.openai.capture.drifts == 0
