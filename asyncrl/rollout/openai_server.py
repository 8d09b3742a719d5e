"""An OpenAI-compatible chat-completions endpoint served by a rollout worker, in the worker's own event loop.

An agent harness written against the `openai` client is trained by pointing its `base_url` at a worker:
`GET /v1/models`, `POST /v1/chat/completions` (`stream` and `n` served) generate through the worker's `Engine`, so
the calls share its batch and weights. A call that names an episode (header `X-Episode-Id`, else the `user` field) is
captured token-exactly into that episode (`asyncrl.rollout.openai_capture`); with `n` > 1, choice i > 0 goes into
the branch `<id>#<i>`, a copy of the episode so far. `finish_episode` turns an episode into one `Trajectory`; one
with no call for `episode_ttl_s` is dropped and counted. Calls of one episode run one at a time, in arrival order.
A streamed call is sent as server-sent events while its tokens are sampled (`asyncrl.rollout.openai_stream`).

Every call passes `asyncrl.cluster.http_guard`: `Host` names the server, a browser's `Origin` is its own, the
API key when one is set (`Authorization: Bearer KEY`), and a POST is `application/json`; a body is capped at
`MAX_BODY_BYTES`. A refused or malformed call gets a 4xx with an OpenAI-shaped error naming the problem.

Beyond the OpenAI shape, a response carries `prompt_token_ids` (what the engine was fed), `choices[i].token_ids`
(what it sampled) and `choices[i].episode_id`, `policy_version` (also in the `X-Policy-Version` header: the newest
weights that produced a token) and `episode_id`. Sampling uses the request's temperature/top_p, defaulting to the
rollout's; the learner assumes `rollout.temperature`/`rollout.top_p`, so a harness that trains should not override
them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from asyncrl.cluster.http_guard import OPENAI_API_KEY_ENV, Guard, beyond_loopback_error, secret
from asyncrl.rollout.engine import Engine, SamplingSpec
from asyncrl.rollout.openai_capture import CapturedEpisode, ChatRenderer, EpisodeCapture, SampledTurn
from asyncrl.rollout.openai_stream import ChoiceStream, ChunkWriter
from asyncrl.types import Prompt, Request, Trajectory

EPISODE_HEADER = "X-Episode-Id"
VERSION_HEADER = "X-Policy-Version"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_N = 64
MAX_BODY_BYTES = 64 << 20
"""A long agent conversation resent on every call outgrows aiohttp's 1 MiB default."""
LISTEN_BACKLOG = 4096
"""Connections the kernel queues for the endpoint before it accepts them (capped by `net.core.somaxconn`). An agent
harness opens a connection per concurrent call, and a worker runs hundreds of episodes at once (the held-out
evaluation and every admitted group at a run's start) on the event loop that also accepts: with aiohttp's default
of 128 the queue overflowed, the kernel dropped the connections it could not queue, and the calls failed
`APIConnectionError` (caused by `ReadError`): 44 episodes at the start of a `calc_agents_sdk` run."""
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


class BadRequest(ValueError):
    """A request field the endpoint cannot honour; `param` names it in the OpenAI error body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    """The fields of a chat-completions request the endpoint honours, checked."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], check=lambda v: True, hint: str = "") -> Any:
    """`body[name]` when present and not null, checked for type and range; BadRequest names the field otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds or not check(value):
        raise BadRequest(name, f"invalid value for '{name}': {value!r}{' (' + hint + ')' if hint else ''}")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"messages[{i}] needs a role in {ROLES}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise BadRequest(f"messages[{i}].content", f"messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(
                f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts"
            )
        out.append({**m, "content": content})
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a request body; BadRequest names the first field the endpoint cannot honour."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    stream = bool(_field(body, "stream", (bool,)))
    options = _field(body, "stream_options", (dict,), hint='an object such as {"include_usage": true}')
    if options is not None and not stream:
        raise BadRequest("stream_options", "'stream_options' needs 'stream': true")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("stream_options.include_usage", f"invalid value for 'include_usage': {include_usage!r}")
    stop = _field(
        body,
        "stop",
        (str, list),
        lambda v: isinstance(v, str) or (len(v) <= 4 and all(isinstance(s, str) and s for s in v)),
    )
    top = _field(body, "top_logprobs", (int,), lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"0..{MAX_TOP_LOGPROBS}") or 0
    logprobs = bool(_field(body, "logprobs", (bool,)))
    if top and not logprobs:
        raise BadRequest("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    max_tokens = _field(body, "max_completion_tokens", (int,), lambda v: v >= 1, ">= 1")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), lambda v: v >= 1, ">= 1")
    tools = _field(
        body,
        "tools",
        (list,),
        lambda v: all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict) for t in v
        ),
        "a list of function tools",
    )
    return ChatRequest(
        messages=_messages(body.get("messages")),
        max_tokens=max_tokens,
        temperature=_field(body, "temperature", (int, float), lambda v: 0 <= v <= 2, "0..2"),
        top_p=_field(body, "top_p", (int, float), lambda v: 0 < v <= 1, "(0, 1]"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=logprobs,
        top_logprobs=top,
        seed=_field(body, "seed", (int,)),
        user=_field(body, "user", (str,)),
        tools=tools or None,
        tool_choice=body.get("tool_choice"),
        n=_field(body, "n", (int,), lambda v: 1 <= v <= MAX_N, f"1..{MAX_N}") or 1,
        stream=stream,
        include_usage=include_usage,
    )


def _stop_cut(text: str, stops: tuple[str, ...]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out of the content)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def assistant_message(turn: SampledTurn, renderer: ChatRenderer, request: ChatRequest) -> dict[str, Any]:
    """The assistant message of a completion. Tool calls (`<tool_call>` JSON blocks, with `tools` in the request)
    are parsed out only when the template renders the parsed message back to exactly the sampled text: otherwise
    the text is returned as content, so a harness that echoes the message never makes the episode drift."""
    text = turn.visible
    plain = {"role": "assistant", "content": text}
    if not request.tools or "<tool_call>" not in text:
        return plain
    try:
        calls = [json.loads(body) for body in TOOL_CALL.findall(text)]
        tool_calls = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for i, c in enumerate(calls)
        ]
    except (ValueError, KeyError, TypeError):
        return plain
    content = text.split("<tool_call>", 1)[0].removesuffix("\n") or None
    parsed = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    echoed = renderer.render([*request.messages, parsed], request.tools, generation_prompt=False)
    return parsed if tool_calls and turn.continuation(echoed) is not None else plain


class OpenAIServer:
    """`/v1/models` and `/v1/chat/completions` for one engine, in the running event loop.

    Args:
        engine: the worker's engine (started).
        renderer: chat template and tokenizer.
        sampling: the worker's sampling (defaults for max_tokens, temperature, top_p, timeout).
        max_model_len: longest prompt + completion the engine serves.
        model_name: the name `/v1/models` reports.
        episode_ttl_s: an episode with no call recorded for this long is dropped (`expire_idle`).
        clock: seconds, for the TTL.
    """

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        sampling: SamplingSpec,
        max_model_len: int,
        model_name: str,
        episode_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.episode_ttl_s = episode_ttl_s
        self.capture = EpisodeCapture(renderer, clock)
        self.url: str | None = None
        self.calls = 0
        self._ids = itertools.count()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._runner: web.AppRunner | None = None
        self.guard = Guard("127.0.0.1", "")
        self.max_body_bytes = MAX_BODY_BYTES
        self.api_key = ""
        """The key a client sends ("" = none asked); the agent harness's client uses it."""
        self.greedy_episodes: set[str] = set()
        """Episodes served at temperature 0 whatever their calls ask (an agent harness's held-out evaluation)."""

    async def start(self, host: str = "127.0.0.1", port: int = 0, api_key: str = "") -> str:
        """Listen on host:port (0: a free port); returns the base URL (`http://host:port`). With `api_key`
        every call must send it; a host beyond loopback needs one (ValueError naming the key otherwise)."""
        try:
            self.guard = Guard(host, api_key)
        except ValueError:
            host_key = "rollout.openai_host"
            raise ValueError(
                beyond_loopback_error("rollout.openai_api_key", OPENAI_API_KEY_ENV, host_key, host)
            ) from None
        self.api_key = api_key
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guarded])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def finish_episode(self, episode_id: str) -> CapturedEpisode:
        """Close an episode once its running call (if any) is recorded; a later call with its id starts a new
        one. KeyError for an episode this endpoint never served."""
        async with self._locks[episode_id]:
            self._locks.pop(episode_id, None)
            return self.capture.finish(episode_id)

    def expire_idle(self) -> int:
        """Drop the episodes idle for longer than the TTL (not one with a call running); returns how many."""
        idle = [e for e in self.capture.idle(self.episode_ttl_s) if not (e in self._locks and self._locks[e].locked())]
        for episode_id in idle:
            self.capture.expire(episode_id)
            self._locks.pop(episode_id, None)
        return len(idle)

    def stats(self) -> dict[str, int]:
        self.expire_idle()
        return {
            "openai_calls": self.calls,
            "openai_drift": self.capture.drifts,
            "openai_open_episodes": len(self.capture.episodes),
            "openai_expired_episodes": self.capture.expired,
        }

    # ---------------------------------------------------------------------------------------------
    # HTTP

    @web.middleware
    async def _guarded(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refusal = self.guard.refusal(request.method, request.headers)
        if refusal is not None:
            kind = "authentication_error" if refusal[0] == 401 else "invalid_request_error"
            return _error(int(refusal[0]), None, refusal[1], kind=kind)
        try:
            return await handler(request)
        except web.HTTPException as e:  # no route, wrong method, body over the cap: the OpenAI error shape
            return _error(e.status, None, f"{e.reason}: {e.text or ''}".strip(": "))

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "asyncrl"}]}
        )

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        self.expire_idle()
        try:
            payload = await http.json()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, None, f"the request body is over {self.max_body_bytes} bytes")
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
            return _error(400, None, f"the request body is not JSON: {type(e).__name__}: {str(e)[:200]}")
        try:
            request = parse_chat_request(payload)
            episode_id = http.headers.get(EPISODE_HEADER) or request.user
            if request.stream:
                return await self._stream(http, request, episode_id)
            body = await self._completion(request, episode_id)
        except BadRequest as e:
            return _error(400, e.param, str(e))
        except EngineFailure as e:
            return _error(503, None, str(e), kind="server_error")
        return web.json_response(body, headers={VERSION_HEADER: str(body["policy_version"])})

    async def _completion(self, request: ChatRequest, episode_id: str | None, on_tokens: OnTokens | None = None):
        """`complete`, one call of an episode at a time."""
        if episode_id is None:
            return await self.complete(request, None, on_tokens)
        async with self._locks[episode_id]:
            return await self.complete(request, episode_id, on_tokens)

    async def _stream(self, http: web.Request, request: ChatRequest, episode_id: str | None) -> web.StreamResponse:
        """Server-sent events written as the tokens are sampled (`asyncrl.rollout.openai_stream`), then
        `data: [DONE]`. A call refused before its first token gets the usual error response; an engine failure
        after it, an `error` event."""
        deltas: asyncio.Queue[tuple[int, list[int], list[float], list[dict[int, float]]]] = asyncio.Queue()
        task = asyncio.ensure_future(self._completion(request, episode_id, lambda *delta: deltas.put_nowait(delta)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even when the client left
        first = asyncio.ensure_future(_next(deltas))
        await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            task.result()  # BadRequest / EngineFailure before any token: the caller's error response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        try:
            await self._send_events(response, request, task, deltas, first)
        except ConnectionResetError:  # the client left: the call still finishes and is captured
            pass
        return response

    async def _send_events(
        self, response: web.StreamResponse, request: ChatRequest, task: asyncio.Future, deltas: asyncio.Queue, first
    ) -> None:
        writer = ChunkWriter(f"chatcmpl-s{next(self._ids)}", int(time.time()), self.model_name)
        streams = [ChoiceStream(self.renderer.decode, request.stop, bool(request.tools)) for _ in range(request.n)]
        send = _sender(response)
        for i in range(request.n):
            await send(writer.role(i))
        pending = [first.result()] if first.done() and not first.cancelled() else []
        while True:
            for i, ids, logprobs, tops in pending:
                piece = streams[i].advance(ids)
                entries = self._entries(ids, logprobs, tops) if request.logprobs else None
                if piece or entries:
                    await send(writer.chunk(i, {"content": piece}, entries))
            if task.done() and deltas.empty():
                break
            pending = [d for d in [await _next_or_none(deltas, task)] if d is not None]
            while not deltas.empty():
                pending.append(deltas.get_nowait())
        try:
            body = task.result()
        except (BadRequest, EngineFailure) as e:
            await send({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        else:
            for choice in body["choices"]:
                rest = streams[choice["index"]].rest(choice["message"]["content"])
                for chunk in writer.ending(choice, rest):
                    await send(chunk)
            if request.include_usage:
                await send(writer.usage(body))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    # ---------------------------------------------------------------------------------------------
    # Completion

    async def complete(
        self, request: ChatRequest, episode_id: str | None, on_tokens: OnTokens | None = None
    ) -> dict[str, Any]:
        """Serve one checked request; with an episode id, capture it (choice i > 0 of `n` into the branch
        `<episode_id>#<i>`). Returns the response body. `on_tokens(choice, ids, logprobs, top_logprobs)` is told
        each batch of sampled tokens as it arrives (a streamed call)."""
        rendered = self._render(request)
        plan = self.capture.plan(episode_id, rendered)
        room = self.max_model_len - len(plan.prompt_ids)
        if room < 1:
            raise BadRequest(
                "messages",
                f"the prompt is {len(plan.prompt_ids)} tokens; this engine serves {self.max_model_len} in all",
            )
        branches = self._branches(episode_id, request.n)
        context = None
        if episode_id is not None and not plan.restart:
            builder = self.capture.episodes[episode_id].builder
            context = builder.oldest_model_version if builder is not None else None
        tops: list[list[dict[int, float]]] = [[] for _ in range(request.n)]
        completions = await asyncio.gather(
            *(
                self._generate(
                    plan.prompt_ids,
                    self._spec(request, room, i, episode_id in self.greedy_episodes),
                    branches[i],
                    tops[i],
                    context,
                    _told(on_tokens, i, tops[i]),
                )
                for i in range(request.n)
            )
        )
        visibles = [_stop_cut(self.renderer.decode(c.response_ids), request.stop) for c in completions]
        choices = [
            (
                c,
                assistant_message(
                    SampledTurn(rendered, self.renderer.decode(c.response_ids, specials=True), v),
                    self.renderer,
                    request,
                ),
            )
            for c, v in zip(completions, visibles, strict=True)
        ]
        if episode_id is not None:
            for branch in branches[1:]:
                self.capture.fork(episode_id, str(branch))
            for branch, completion, visible in zip(branches, completions, visibles, strict=True):
                self.capture.record(str(branch), plan, completion, visible)
        self.calls += 1
        return self._body(request, choices, tops, branches)

    def _render(self, request: ChatRequest) -> str:
        try:
            return self.renderer.render(request.messages, request.tools, tool_choice=request.tool_choice)
        except Exception as e:  # the template rejected the conversation (a missing field, a role it refuses)
            raise BadRequest(
                "messages", f"the chat template cannot render these messages: {type(e).__name__}: {e}"
            ) from e

    def _branches(self, episode_id: str | None, n: int) -> list[str | None]:
        """The episode each of `n` choices is captured into: the episode, then its branches `<id>#1`, ..."""
        if episode_id is None:
            return [None] * n
        branches = [episode_id] + [f"{episode_id}#{i}" for i in range(1, n)]
        for branch in branches[1:]:
            if branch in self.capture.episodes:
                raise BadRequest("n", f"episode {branch!r} (choice branch) is open: finish it before asking n={n}")
        return list(branches)

    def _spec(self, request: ChatRequest, room: int, choice: int = 0, greedy: bool = False) -> SamplingSpec:
        base = self.sampling
        temperature = base.temperature if request.temperature is None else float(request.temperature)
        return dataclasses.replace(
            base,
            max_tokens=min(request.max_tokens or base.max_tokens, room),
            temperature=0.0 if greedy else temperature,
            top_p=base.top_p if request.top_p is None else float(request.top_p),
            stop=request.stop,
            top_logprobs=request.top_logprobs,
            seed=None if request.seed is None else request.seed + choice,
            ignore_eos=False,
        )

    async def _generate(
        self,
        prompt_ids: list[int],
        spec: SamplingSpec,
        episode_id: str | None,
        tops: list,
        context: int | None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
    ) -> Trajectory:
        n = next(self._ids)
        prompt = Prompt(prompt_id=f"openai-{n}", prompt_ids=prompt_ids, ground_truth="")
        request = Request(
            request_id=f"openai/{episode_id or '-'}/{n}",
            group_id=episode_id or f"openai-{n}",
            sample_index=0,
            group_size=1,
            prompt=prompt,
            context_min_version=context,
        )
        told = {} if on_tokens is None else {"on_tokens": on_tokens}
        completion = await self.engine.generate(request, spec, top_logprobs=tops, **told)
        if completion.failed:
            raise EngineFailure(f"generation failed: {completion.failure}")
        return completion

    def _body(
        self,
        request: ChatRequest,
        choices: list[tuple[Trajectory, dict[str, Any]]],
        tops: list[list[dict[int, float]]],
        branches: list[str | None],
    ) -> dict[str, Any]:
        first = choices[0][0]
        prompt_tokens = len(first.prompt_ids)
        completion_tokens = sum(len(completion.response_ids) for completion, _ in choices)
        return {
            "id": f"chatcmpl-{first.prompt_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": i,
                    "message": message,
                    "finish_reason": "tool_calls" if "tool_calls" in message else completion.finish_reason,
                    "logprobs": {"content": self._logprobs(completion, tops[i])} if request.logprobs else None,
                    "token_ids": completion.response_ids.tolist(),
                    "episode_id": branches[i],
                }
                for i, (completion, message) in enumerate(choices)
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "prompt_token_ids": first.prompt_ids.tolist(),
            "policy_version": max(completion.max_version for completion, _ in choices),
            "episode_id": branches[0],
        }

    def _logprobs(self, completion: Trajectory, tops: list[dict[int, float]]) -> list[dict[str, Any]]:
        return self._entries(completion.response_ids.tolist(), completion.rollout_logprobs.tolist(), tops)

    def _entries(self, ids: list[int], logprobs: list[float], tops: list[dict[int, float]]) -> list[dict[str, Any]]:
        """OpenAI's log-prob entries of sampled tokens: each token, its log-prob and its top alternatives."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.renderer.decode([token_id], specials=True)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        # strict: the engine reports the alternatives of every position it sampled
        return [
            {
                **entry(int(t), float(lp)),
                "top_logprobs": [entry(a, b) for a, b in sorted(top.items(), key=lambda kv: -kv[1])],
            }
            for t, lp, top in zip(ids, logprobs, tops, strict=True)
        ]


class EngineFailure(RuntimeError):
    """The engine did not finish the generation (timeout, abort, error): a 503 the harness may retry."""


OnTokens = Callable[[int, list[int], list[float], list[dict[int, float]]], None]
"""Told (choice index, new token ids, their log-probs, their top log-probs) as a streamed call's tokens arrive."""


def _told(on_tokens: OnTokens | None, choice: int, tops: list[dict[int, float]]):
    """The engine's `on_tokens` of one choice: `on_tokens` with the choice index and the batch's top log-probs
    (the engine fills `tops` before it tells)."""
    if on_tokens is None:
        return None
    return lambda ids, logprobs: on_tokens(choice, ids, logprobs, tops[len(tops) - len(ids) :])


async def _next(queue: asyncio.Queue) -> Any:
    return await queue.get()


async def _next_or_none(queue: asyncio.Queue, task: asyncio.Future) -> Any:
    """The queue's next item, or None once `task` is done with the queue empty."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return queue.get_nowait() if not queue.empty() else None


def _sender(response: web.StreamResponse):
    async def send(event: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())

    return send


def _error(status: int, param: str | None, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def port_for(base_port: int, worker_name: str) -> int:
    """`rollout.openai_port` for one worker: -1 = a free port, N = N + the worker's index (`rollout-3` -> N + 3)."""
    if base_port < 0:
        return 0
    suffix = worker_name.rsplit("-", 1)[-1]
    return base_port + (int(suffix) if suffix.isdigit() else 0)


async def start_worker_endpoint(
    engine: Engine, rollout: Any, model_dir: str, max_model_len: int, sampling: SamplingSpec, worker_name: str
) -> OpenAIServer:
    """The endpoint of one rollout worker, listening on `rollout.openai_host` and its port (`port_for`)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from asyncrl.models.templates import load_chat_template

    # loaded as vLLM and the controller load it, so the three encode alike (docs/tokenizers.md)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = load_chat_template(rollout.openai_chat_template) if rollout.openai_chat_template else None
    renderer = ChatRenderer(tokenizer, template)
    name = Path(model_dir).name
    server = OpenAIServer(engine, renderer, sampling, max_model_len, name, rollout.openai_episode_ttl_s)
    api_key = secret(rollout.openai_api_key, OPENAI_API_KEY_ENV)
    await server.start(rollout.openai_host, port_for(rollout.openai_port, worker_name), api_key)
    return server
