"""Tool calls a model makes, through the OpenAI endpoint of a real vLLM engine, with the real `openai` client and an
unmodified agent framework (the OpenAI Agents SDK).

The model is the `calc_chat` recipe's: a tiny Qwen2 with a BPE tokenizer and the ChatML template, warm-started on
tool-calling conversations (`asyncrl.envs.warm_start.warm_start_chat_calc`, cached under $ASYNCRL_CACHE: minutes the
first time). Greedy, it calls the calculator with a well-formed Hermes-style `<tool_call>` block on every held-out
problem (it does not yet copy the operands right; the checks here are about the round trip, not the answer).
"""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.envs import calc, chat_calc

pytestmark = pytest.mark.e2e

PROBLEMS = calc.heldout_problems("calc", 4)


@pytest.fixture(scope="module")
def model_dir():
    from asyncrl.envs.model_dir import ensure_model

    return ensure_model(load_config("calc_chat", []))


@pytest.fixture(scope="module")
def worker(loop, model_dir):
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.worker import RolloutWorker, WorkerSpec

    rollout = RolloutConfig(openai_port=-1, max_tokens=48, max_model_len=1024, max_requests_in_flight=8)
    worker = RolloutWorker("rollout-0", WorkerSpec(str(model_dir), rollout=rollout, max_model_len=1024))
    loop.run_until_complete(worker.ready())
    yield worker
    loop.run_until_complete(worker.shutdown())


def client(url: str, episode: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers={"X-Episode-Id": episode})


async def _streamed(c, **kwargs) -> tuple[dict, str, list[int]]:
    """The assistant message a streaming client assembles from the chunks, the finish reason and the token ids."""
    content, calls, finish, ids = "", [], None, []
    async for chunk in await c.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [t.model_dump(exclude_none=True) for t in choice.delta.tool_calls or []]
            finish, ids = choice.finish_reason or finish, getattr(choice, "token_ids", None) or ids
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in t.items() if k != "index"} for t in calls]
    return message, finish, ids


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_warm_start_calls_the_tool_and_the_next_turn_continues_the_episode_token_exactly(loop, worker, stream):
    text, _ = PROBLEMS[0]
    episode = f"tool-{stream}"

    async def run():
        c, messages, turns = client(worker.openai.url, episode), chat_calc.question(text), []
        for _ in range(2):
            kwargs = dict(model="m", messages=messages, tools=[chat_calc.CALCULATOR_TOOL], temperature=0.0)
            if stream:
                message, finish, ids = await _streamed(c, **kwargs)
            else:
                r = await c.chat.completions.create(**kwargs)
                message, finish, ids = r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason, r.choices[0].token_ids
            turns.append((message, finish, ids))
            messages.append(message)
            for call in message.get("tool_calls", []):
                result = chat_calc.run_tool(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return turns, messages, await worker.finish_episode(episode, reward=0.0)

    drifts = worker.openai.capture.drifts
    turns, messages, t = loop.run_until_complete(run())
    (first, finish, ids), (_, _, second_ids) = turns
    assert finish == "tool_calls" and first.get("content") is None and len(first["tool_calls"]) == 1
    call = first["tool_calls"][0]["function"]
    assert call["name"] == "calculator" and isinstance(json.loads(call["arguments"])["expression"], str)
    # one trajectory: the call's tokens, the tool result as the template writes it (not trained), the next turn
    assert len(t.turn_starts) == 2 and worker.openai.capture.drifts == drifts
    assert t.response_ids[: len(ids)].tolist() == ids and t.loss_mask[: len(ids)].all()
    start = t.turn_starts[1]
    assert t.response_ids[start : start + len(second_ids)].tolist() == second_ids
    observation = worker.openai.renderer.decode(t.response_ids[len(ids) : start].tolist(), specials=True)
    assert observation == f"\n<|im_start|>user\n<tool_response>\n{messages[3]['content']}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert not t.loss_mask[len(ids) : start].any()


def test_the_agents_sdk_drives_whole_episodes_through_the_endpoint_without_drift(loop, worker):
    pytest.importorskip("agents")
    from asyncrl.envs import agents_sdk
    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    env = OpenAIAgentEnv(agents_sdk.agent, worker.openai, 120.0)
    drifts = worker.openai.capture.drifts

    async def episodes():
        requests = [make_request(make_prompt(f"q{i}", text=t, ground_truth=a), sample_index=0) for i, (t, a) in enumerate(PROBLEMS)]
        return [await env.rollout(r, "rollout-0", greedy=True) for r in requests]

    for t in loop.run_until_complete(episodes()):
        assert t.failure is None and t.tool_calls >= 1 and 2 <= len(t.turn_starts) <= chat_calc.MAX_MODEL_CALLS
        assert t.loss_mask[t.turn_starts[0]] == 1 and t.rollout_logprobs[t.loss_mask == 1].max() <= 0
    assert worker.openai.capture.drifts == drifts
