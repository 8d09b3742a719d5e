"""Request checking of the OpenAI endpoint: every field it cannot honour is a 400 that names the field."""

from __future__ import annotations

import pytest

from asyncrl.models.templates import load_chat_template
from asyncrl.rollout.openai_server import BadRequest, parse_chat_request, port_for

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": USER, "temperature": 5}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": 65}, "n"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": "8"}, "max_completion_tokens"),
        ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools"),
        ({"messages": USER, "seed": True}, "seed"),
    ],
)
def test_bad_field_is_named(body, param):
    with pytest.raises(BadRequest) as e:
        parse_chat_request(body)
    assert e.value.param == param


def test_good_request_is_read_with_its_defaults():
    r = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                            "max_tokens": 5, "max_completion_tokens": 7, "stop": "\n", "logprobs": True, "top_logprobs": 2, "user": "ep"})
    assert r.messages[0]["content"] == "ab"
    assert (r.max_tokens, r.stop, r.top_logprobs, r.user, r.temperature) == (7, ("\n",), 2, "ep", None)  # max_completion_tokens wins
    assert (r.n, r.stream, r.include_usage) == (1, False, False)
    r = parse_chat_request({"messages": USER, "n": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert (r.n, r.stream, r.include_usage) == (3, True, True)


def test_ports_per_worker():
    assert port_for(8000, "rollout-3") == 8003
    assert port_for(-1, "rollout-3") == 0  # a free port, reported by the worker


def test_template_names_and_paths(tmp_path):
    assert "<tool_call>" in load_chat_template("qwen2_tools")
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}"
    with pytest.raises(FileNotFoundError, match="qwen2_tools"):
        load_chat_template("vicuna")


def test_agent_import_path_must_name_an_async_function():
    from asyncrl.rollout.openai_agent import resolve_agent

    assert resolve_agent("asyncio:sleep").__name__ == "sleep"
    with pytest.raises(ValueError, match="async function"):
        resolve_agent("json:dumps")
    with pytest.raises(ValueError, match="import path"):
        resolve_agent("nocolon")
