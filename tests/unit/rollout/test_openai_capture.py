"""Episode capture for the OpenAI endpoint, on the char tokenizer (one token per character: every count below is a
character count you can check by hand). Completions are scripted token lists, as the engine would return them."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.models.templates import SHIPPED, load_chat_template
from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer
from asyncrl.rollout.openai_capture import ChatRenderer, EpisodeCapture, SampledTurn
from asyncrl.rollout.openai_server import ChatRequest, assistant_message
from asyncrl.types import Trajectory

EOS = 2
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ASCII_ALPHABET)


def renderer_for(tokenizer, name: str) -> ChatRenderer:
    return ChatRenderer(tokenizer, load_chat_template(name))


def completion(tokenizer, text: str, *, eos: bool = True, version: int = 0) -> Trajectory:
    ids = tokenizer.encode(text, add_special_tokens=False) + ([EOS] if eos else [])
    n = len(ids)
    return Trajectory(
        prompt_id="p", group_id="g", sample_index=0, prompt_ids=np.zeros(1, np.int32), response_ids=np.asarray(ids, np.int32),
        rollout_logprobs=-np.arange(1, n + 1, dtype=np.float32) / 10, loss_mask=np.ones(n, np.int8),
        versions=np.full(n, version, np.int32), finish_reason="stop" if eos else "length", dispatch_version=version,
    )


def call(capture: EpisodeCapture, messages, sampled: Trajectory, tools=None, episode="e"):
    """One endpoint call: render, plan, record; returns (plan, assistant message as returned)."""
    rendered = capture.renderer.render(messages, tools)
    plan = capture.plan(episode, rendered)
    visible = capture.renderer.decode(sampled.response_ids)
    capture.record(episode, plan, sampled, visible)
    turn = SampledTurn(rendered, capture.renderer.decode(sampled.response_ids, specials=True), visible)
    return plan, assistant_message(turn, capture.renderer, ChatRequest(messages=messages, tools=tools))


def test_default_template_episode_is_token_exact_and_keeps_the_sampled_eos(tokenizer):
    capture = EpisodeCapture(renderer_for(tokenizer, "default"))
    messages = [{"role": "user", "content": "2+3?"}]
    plan1, reply = call(capture, messages, completion(tokenizer, "5"))
    assert plan1.restart and len(plan1.prompt_ids) == 4
    messages += [reply, {"role": "user", "content": "ok"}]
    plan2, _ = call(capture, messages, completion(tokenizer, "yes", version=1))
    # The context is the prompt, "5" and the EOS the engine sampled (the template does not render it), then "ok".
    assert not plan2.restart and plan2.observation == tokenizer.encode("ok", add_special_tokens=False)
    assert plan2.prompt_ids == plan1.prompt_ids + tokenizer.encode("5", add_special_tokens=False) + [EOS] + plan2.observation
    t = capture.finish("e").trajectory(prompt_id="p", group_id="g", sample_index=0)
    assert t.prompt_ids.tolist() == plan1.prompt_ids
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1]  # "5" EOS | "ok" | "yes" EOS
    assert t.turn_starts == [0, 4]
    assert t.versions.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # the observation carries the version before it
    assert np.allclose(t.rollout_logprobs, [-0.1, -0.2, 0, 0, -0.1, -0.2, -0.3, -0.4])
    assert t.response_text == "5yes" and capture.drifts == 0


@pytest.mark.parametrize("name", SHIPPED)
def test_tool_call_round_trip_has_no_drift_on_every_shipped_template(tokenizer, name):
    capture = EpisodeCapture(renderer_for(tokenizer, name))
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    _, reply = call(capture, messages, completion(tokenizer, CALL_TEXT), tools=TOOLS)
    if name != "default":  # every shipped chat format writes tool calls as <tool_call> blocks
        assert reply["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "2+3"}'} and reply["content"] is None
    messages += [reply, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    plan2, _ = call(capture, messages, completion(tokenizer, "It is 5."), tools=TOOLS)
    messages += [{"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "thanks"}]
    plan3, _ = call(capture, messages, completion(tokenizer, "bye", eos=False), tools=TOOLS)
    assert not plan2.restart and not plan3.restart and capture.drifts == 0
    if name == "qwen2_tools":  # the tool result turn, exactly as the template writes it
        expected = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(plan2.observation) == expected


def test_a_non_canonical_tool_call_is_returned_as_text_so_the_echo_still_extends(tokenizer):
    capture = EpisodeCapture(renderer_for(tokenizer, "qwen2_tools"))
    messages = [{"role": "user", "content": "2+3?"}]
    squeezed = '<tool_call>\n{"name":"calc","arguments":{"expr":"2+3"}}\n</tool_call>'  # not the template's spacing
    _, reply = call(capture, messages, completion(tokenizer, squeezed), tools=TOOLS)
    assert reply == {"role": "assistant", "content": squeezed}
    messages += [reply, {"role": "user", "content": "go on"}]
    plan, _ = call(capture, messages, completion(tokenizer, "5"), tools=TOOLS)
    assert not plan.restart and capture.drifts == 0


def test_edited_history_counts_drift_and_the_trajectory_is_the_last_segment(tokenizer):
    capture = EpisodeCapture(renderer_for(tokenizer, "default"))
    call(capture, [{"role": "user", "content": "ab"}], completion(tokenizer, "cd"))
    # The harness rewrote the assistant turn: "cX" instead of "cd".
    plan, _ = call(capture, [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cX"}], completion(tokenizer, "e"))
    assert plan.restart and plan.prompt_ids == tokenizer.encode("abcX", add_special_tokens=False)
    episode = capture.finish("e")
    assert (episode.drifts, episode.dropped_model_tokens, capture.drifts) == (1, 3, 1)  # "c", "d", EOS not trained
    t = episode.trajectory(prompt_id="p", group_id="g", sample_index=0)
    assert tokenizer.decode(t.prompt_ids.tolist()) == "abcX" and t.loss_mask.tolist() == [1, 1]


def test_unknown_episode_starts_one_and_finish_of_a_never_served_id_names_it(tokenizer):
    capture = EpisodeCapture(renderer_for(tokenizer, "default"))
    call(capture, [{"role": "user", "content": "hi"}], completion(tokenizer, "x"), episode="new")
    assert list(capture.episodes) == ["new"]
    with pytest.raises(KeyError, match="nope"):
        capture.finish("nope")


def test_stop_string_tokens_stay_in_the_context(tokenizer):
    """The engine sampled "5;" and stopped on ";": the harness sees "5", the context keeps both tokens."""
    capture = EpisodeCapture(renderer_for(tokenizer, "default"))
    rendered = capture.renderer.render([{"role": "user", "content": "q"}])
    plan = capture.plan("e", rendered)
    capture.record("e", plan, completion(tokenizer, "5;", eos=False), visible="5")
    plan2 = capture.plan("e", capture.renderer.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "5"}, {"role": "user", "content": "!"}]))
    assert plan2.prompt_ids == tokenizer.encode("q5;!", add_special_tokens=False)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_episode_expires_after_its_ttl_and_is_counted_but_not_one_with_a_call_running(tokenizer):
    from asyncrl.rollout.openai_server import OpenAIServer

    clock = FakeClock()
    server = OpenAIServer(None, renderer_for(tokenizer, "default"), None, 1024, "m", episode_ttl_s=600.0, clock=clock)
    hi = [{"role": "user", "content": "hi"}]
    for episode in ("old", "busy", "young"):
        call(server.capture, hi, completion(tokenizer, "x"), episode=episode)
        clock.now += 300.0 if episode == "busy" else 0.0
    clock.now += 301.0  # old: 601 s idle, busy: 601 s idle with a call running, young: 301 s idle
    server._locks["busy"].locked = lambda: True  # a call of it is being generated
    assert server.expire_idle() == 1 and sorted(server.capture.episodes) == ["busy", "young"]
    assert server.stats()["openai_expired_episodes"] == 1 and server.stats()["openai_open_episodes"] == 2
    call(server.capture, hi, completion(tokenizer, "y"), episode="young")  # a call resets its idle time
    clock.now += 599.0
    del server._locks["busy"]
    assert server.expire_idle() == 1 and list(server.capture.episodes) == ["young"]
    with pytest.raises(KeyError, match="idle past its TTL"):
        server.capture.finish("old")


def test_each_choice_of_n_is_its_own_branch_sharing_the_episode_so_far(tokenizer):
    capture = EpisodeCapture(renderer_for(tokenizer, "default"))
    first = [{"role": "user", "content": "hi"}]
    call(capture, first, completion(tokenizer, "ab"))
    then = first + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "more"}]
    plan = capture.plan("e", capture.renderer.render(then))
    capture.fork("e", "e#1")
    for branch, text in (("e", "cd"), ("e#1", "xyz")):
        sampled = completion(tokenizer, text, version=1)
        capture.record(branch, plan, sampled, text)
    with pytest.raises(ValueError, match="'e#1' is open"):
        capture.fork("e", "e#1")  # a later n > 1 call of the episode while its branch is not finished
    a = capture.finish("e").trajectory(prompt_id="p", group_id="g", sample_index=0)
    b = capture.finish("e#1").trajectory(prompt_id="p", group_id="g", sample_index=1)
    shared = a.turn_starts[1]
    assert shared == b.turn_starts[1] and a.response_ids[:shared].tolist() == b.response_ids[:shared].tolist()
    assert tokenizer.decode(a.response_ids[shared:].tolist(), skip_special_tokens=True) == "cd"
    assert b.response_text == "abxyz"
    assert b.versions.tolist() == [0, 0, 0] + [0] * (shared - 3) + [1, 1, 1, 1]  # "ab" + EOS, observation, "xyz" + EOS
