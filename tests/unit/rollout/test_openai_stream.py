"""Streamed chat completions (`stream: true`): chunks written while the engine samples, on the char tokenizer (one
token per character) with a scripted engine that hands tokens over one at a time and waits where a test tells it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from asyncrl.models.templates import load_chat_template
from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer
from asyncrl.rollout.openai_capture import ChatRenderer
from asyncrl.rollout.openai_server import OpenAIServer
from asyncrl.rollout.openai_stream import ChoiceStream, safe_prefix
from asyncrl.rollout.sampling import SamplingSpec
from asyncrl.types import Trajectory

EOS = 2
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ASCII_ALPHABET)


def test_safe_prefix_holds_back_what_may_begin_a_stop_string_or_a_tool_call():
    holds = ("STOP", "\n<tool_call>", "<tool_call>")
    assert safe_prefix("hello", holds) == "hello"
    assert safe_prefix("hello ST", holds) == "hello "  # may become STOP
    assert safe_prefix("hello STOP and more", holds) == "hello "
    assert safe_prefix("a\n", holds) == "a"  # may become "\n<tool_call>"
    assert safe_prefix("a\n<tool", holds) == "a"
    assert safe_prefix("a\n<tool_call>\n{", holds) == "a"
    assert safe_prefix("a\nb", holds) == "a\nb"
    assert safe_prefix("caf\ufffd", ()) == "caf"  # an incomplete character waits for its next byte


def test_choice_stream_sends_each_piece_once_and_the_rest_at_the_end(tokenizer):
    stream = ChoiceStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), ("!",), tools=True)
    pieces = [stream.advance(tokenizer.encode(c, add_special_tokens=False)) for c in "ab\n<tool_call>"]
    assert pieces == ["a", "b", "", "", "", "", "", "", "", "", "", "", "", ""]
    assert stream.rest("ab") == "" and stream.rest("ab\n<x>") == "\n<x>"  # a tool call or plain text, decided at the end


class PacedEngine:
    """Samples `text` + EOS, handing each token to `on_tokens` as it goes; after `pause_after` tokens it waits for
    `go` (so a test can look at what the client has while the generation is still running)."""

    def __init__(self, tokenizer, text: str, pause_after: int):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
        self.pause_after, self.go, self.handed, self.temperatures = pause_after, asyncio.Event(), 0, []

    async def generate(self, request, spec, top_logprobs=None, on_tokens=None) -> Trajectory:
        self.temperatures.append(spec.temperature)
        for k, token in enumerate(self.ids):
            if k == self.pause_after:
                await self.go.wait()
            if top_logprobs is not None:
                top_logprobs.append({token: -0.5})
            self.handed += 1
            if on_tokens is not None:
                on_tokens([token], [-0.5])
            await asyncio.sleep(0)
        n = len(self.ids)
        return Trajectory(
            prompt_id=request.prompt.prompt_id, group_id=request.group_id, sample_index=0,
            prompt_ids=np.asarray(request.prompt.prompt_ids, np.int32), response_ids=np.asarray(self.ids, np.int32),
            rollout_logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.int8), versions=np.zeros(n, np.int32),
            finish_reason="stop",
        )  # fmt: skip


def _serve(tokenizer, engine) -> OpenAIServer:
    renderer = ChatRenderer(tokenizer, load_chat_template("chatml"))
    return OpenAIServer(engine, renderer, SamplingSpec(max_tokens=64), 1024, "paced")


def test_the_first_chunks_reach_the_client_before_the_engine_has_sampled_the_rest(tokenizer):
    import openai

    engine = PacedEngine(tokenizer, "hello world", pause_after=3)
    server = _serve(tokenizer, engine)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{await server.start()}/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="paced", messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True,
            stream_options={"include_usage": True}, extra_headers={"X-Episode-Id": "s"},
        )  # fmt: skip
        seen, handed_at = [], []
        async for chunk in stream:
            seen.append(chunk)
            handed_at.append(engine.handed)
            if "".join(c.choices[0].delta.content or "" for c in seen if c.choices) == "hel":
                assert engine.handed == 3  # the engine waits: these chunks were sent while it was generating
                engine.go.set()
        captured = await server.finish_episode("s")
        await server.stop()
        return seen, handed_at, captured

    seen, handed_at, captured = asyncio.run(run())
    body = [c.choices[0] for c in seen if c.choices]
    assert body[0].delta.role == "assistant"
    assert [c.delta.content for c in body[1:-1]] == list("hello world") + [""]  # EOS: a log-prob, no text
    assert [len(c.logprobs.content) for c in body[1:-1]] == [1] * 12
    assert max(handed_at[:4]) == 3 < len(engine.ids)  # role + "hel": received while the engine waited
    assert body[-1].finish_reason == "stop" and body[-1].token_ids == engine.ids
    assert seen[-1].usage.completion_tokens == 12 and captured.calls == 1 and captured.drifts == 0


def test_a_streamed_tool_call_is_sent_as_tool_calls_never_as_content(tokenizer):
    import openai

    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    engine = PacedEngine(tokenizer, "ok\n" + call, pause_after=0)
    engine.go.set()
    server = _serve(tokenizer, engine)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{await server.start()}/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="paced", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS, stream=True
        )
        chunks = [c async for c in stream]
        await server.stop()
        return chunks

    body = [c.choices[0] for c in asyncio.run(run())]
    assert "".join(c.delta.content or "" for c in body) == "ok"
    calls = [t for c in body for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [(0, "calc", '{"expr": "2+3"}')]
    assert body[-1].finish_reason == "tool_calls"


def test_a_refused_streamed_call_gets_the_error_response_not_a_stream(tokenizer):
    import openai

    server = _serve(tokenizer, PacedEngine(tokenizer, "x", pause_after=0))
    server.max_model_len = 8  # every prompt is longer

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{await server.start()}/v1", api_key="x", max_retries=0)
        try:
            await client.chat.completions.create(model="paced", messages=[{"role": "user", "content": "hi"}], stream=True)
        except openai.BadRequestError as e:
            return e
        finally:
            await server.stop()

    error = asyncio.run(run())
    assert error.status_code == 400 and error.param == "messages" and "serves 8 in all" in str(error)


def test_a_greedy_agent_rollout_is_served_at_temperature_0_and_keeps_the_harness_tool_call_count(tokenizer):
    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    engine = PacedEngine(tokenizer, "4", pause_after=0)
    engine.go.set()
    server = _serve(tokenizer, engine)

    async def harness(client, prompt, episode):  # asks for temperature 1 and reports two tool calls
        await client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": prompt}], temperature=1.0)
        return 1.0, {"tool_calls": 2}

    async def miscounting(client, prompt, episode):
        await client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": prompt}])
        return 1.0, {"tool_calls": "two"}

    async def run():
        await server.start()
        request = make_request(make_prompt("q", text="2+2?", ground_truth="4"), sample_index=0)
        greedy = await OpenAIAgentEnv(harness, server, 30.0).rollout(request, "rollout-0", greedy=True)
        sampled = await OpenAIAgentEnv(harness, server, 30.0).rollout(request, "rollout-0")
        bad = await OpenAIAgentEnv(miscounting, server, 30.0).rollout(request, "rollout-0")
        await server.stop()
        return greedy, sampled, bad

    greedy, sampled, bad = asyncio.run(run())
    assert engine.temperatures == [0.0, 1.0, 1.0] and not server.greedy_episodes
    assert (greedy.tool_calls, greedy.reward, sampled.tool_calls) == (2, 1.0, 2)
    assert bad.failure == "agent_error: the agent returned tool_calls 'two', not a count"


def test_a_harness_error_names_what_caused_it(tokenizer):
    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    server = _serve(tokenizer, PacedEngine(tokenizer, "4", pause_after=0))

    async def unreachable(client, prompt, episode):  # the openai client's "Connection error." hides its cause
        raise RuntimeError("Connection error.") from ConnectionRefusedError("port 9 refused")

    async def run():
        await server.start()
        request = make_request(make_prompt("q", text="2+2?", ground_truth="4"), sample_index=0)
        failed = await OpenAIAgentEnv(unreachable, server, 30.0).rollout(request, "rollout-0")
        await server.stop()
        return failed

    failed = asyncio.run(run())
    assert failed.failure == "agent_error: RuntimeError: Connection error. (caused by ConnectionRefusedError: port 9 refused)"


def test_hundreds_of_episodes_calling_at_once_on_a_busy_loop_all_connect(tokenizer):
    from asyncrl.rollout.openai_agent import OpenAIAgentEnv
    from asyncrl.testing import make_prompt, make_request

    engine = PacedEngine(tokenizer, "4", pause_after=0)
    engine.go.set()
    server = _serve(tokenizer, engine)

    async def harness(client, prompt, episode):
        await client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": prompt}])
        return 1.0

    async def busy():  # the worker's loop also handles engine outputs: it accepts connections late
        for _ in range(40):
            time.sleep(0.05)
            await asyncio.sleep(0)

    async def run():
        await server.start()
        env = OpenAIAgentEnv(harness, server, 60.0)
        requests = [make_request(make_prompt(f"q{i}", text="2+2?", ground_truth="4"), sample_index=0) for i in range(800)]
        asyncio.ensure_future(busy())
        done = await asyncio.gather(*(env.rollout(r, "rollout-0") for r in requests))
        await server.stop()
        return done

    failed = [t.failure for t in asyncio.run(run()) if t.failure]
    assert not failed, (len(failed), failed[:2])  # with aiohttp's default backlog of 128: ~150 ReadErrors
