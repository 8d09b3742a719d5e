"""A streamed chat completion (`stream: true`): OpenAI's `chat.completion.chunk` server-sent events, written while the
engine samples.

Each choice opens with its role chunk; then every batch of tokens vLLM hands over (one per engine step, more when
steps coalesce) is sent as it arrives: the text it adds and, with `logprobs`, one entry per token. Text that may
still turn out not to be content is held back until it is decided: a suffix that could begin a stop string, and
with `tools`, one that could begin a `<tool_call>` block (the block itself is never sent as content). When the
generation ends, the rest of the content follows, or for a message the endpoint parsed tool calls out of, the
calls in one chunk; then `finish_reason` with this endpoint's `token_ids` and `episode_id`; with
`stream_options.include_usage` a last chunk with no choices carries the usage (and `prompt_token_ids`,
`policy_version`, `episode_id`). The episode is captured exactly as for a call that is not streamed.
"""

from __future__ import annotations

from typing import Any

TOOL_CALL_OPENINGS = ("\n<tool_call>", "<tool_call>")


def safe_prefix(text: str, holds: tuple[str, ...]) -> str:
    """The part of `text` that is content whatever comes next: before the first of `holds` it contains, less an
    incomplete character (U+FFFD at the end) and a suffix that could begin one of `holds`."""
    cuts = [i for i in (text.find(h) for h in holds) if i >= 0]
    text = text[: min(cuts)] if cuts else text
    text = text.rstrip("\ufffd")
    for k in range(min(len(text), max((len(h) for h in holds), default=1) - 1), 0, -1):
        if any(h.startswith(text[-k:]) for h in holds):
            return text[:-k]
    return text


class ChoiceStream:
    """The content of one choice sent so far, advanced token batch by token batch."""

    def __init__(self, decode: Any, stops: tuple[str, ...], tools: bool) -> None:
        self.decode = decode
        self.holds = tuple(stops) + (TOOL_CALL_OPENINGS if tools else ())
        self.ids: list[int] = []
        self.sent = ""

    def advance(self, new_ids: list[int]) -> str:
        """The content these tokens add that can be sent now ("" while it is held back)."""
        self.ids += new_ids
        safe = safe_prefix(self.decode(self.ids), self.holds)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece

    def rest(self, content: str | None) -> str:
        """What is left to send of the final message `content` (it extends what was sent)."""
        content = content or ""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


class ChunkWriter:
    """`chat.completion.chunk` bodies of one completion (`id`, `created`, `model` shared)."""

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(self, index: int, delta: dict[str, Any], entries: list | None = None, **extra: Any) -> dict[str, Any]:
        logprobs = None if entries is None else {"content": entries}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None, **extra}
        return {**self.head, "choices": [choice]}

    def role(self, index: int) -> dict[str, Any]:
        return self.chunk(index, {"role": "assistant", "content": ""})

    def ending(self, choice: dict[str, Any], rest: str) -> list[dict[str, Any]]:
        """The last chunks of a finished choice (`rest`: its content not sent yet): the rest of the content or the
        tool calls, then `finish_reason` with `token_ids` and `episode_id`."""
        i, message, out = choice["index"], choice["message"], []
        if "tool_calls" in message:
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            out.append(self.chunk(i, {"content": rest or None, "tool_calls": calls}))
        elif rest:
            out.append(self.chunk(i, {"content": rest}))
        extra = {"token_ids": choice["token_ids"], "episode_id": choice["episode_id"]}
        return [*out, self.chunk(i, {}, **{**extra, "finish_reason": choice["finish_reason"]})]

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        extras = {k: body[k] for k in ("usage", "prompt_token_ids", "policy_version", "episode_id")}
        return {**self.head, "choices": [], **extras}
