"""An OpenAI-compatible chat-completions endpoint served by a rollout worker, in the worker's own event loop.

An agent harness written against the `openai` client is trained by pointing its `base_url` at a worker:
`GET /v1/models`, `POST /v1/chat/completions` (non-streaming, n=1) generate through the worker's `Engine`, so the
calls share its batch and weights. A call that names an episode (header `X-Episode-Id`, else the `user` field) is
captured token-exactly into that episode (`asyncrl.rollout.openai_capture`); `finish_episode` turns it into one
`Trajectory`. Calls of one episode run one at a time, in arrival order.

Every call passes `asyncrl.cluster.http_guard`: `Host` names the server, a browser's `Origin` is its own, the
API key when one is set (`Authorization: Bearer KEY`), and a POST is `application/json`; a body is capped at
`MAX_BODY_BYTES`. A refused or malformed call gets a 4xx with an OpenAI-shaped error naming the problem.

Beyond the OpenAI shape, a response carries `prompt_token_ids` (what the engine was fed), `choices[0].token_ids`
(what it sampled), `policy_version` (also in the `X-Policy-Version` header: the newest weights that produced a
token) and `episode_id`. Sampling uses the request's temperature/top_p, defaulting to the rollout's; the learner
assumes `rollout.temperature`/`rollout.top_p`, so a harness that trains should not override them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from asyncrl.cluster.http_guard import OPENAI_API_KEY_ENV, Guard, beyond_loopback_error, secret
from asyncrl.rollout.engine import Engine, SamplingSpec
from asyncrl.rollout.openai_capture import CapturedEpisode, ChatRenderer, EpisodeCapture, SampledTurn
from asyncrl.types import Prompt, Request, Trajectory

EPISODE_HEADER = "X-Episode-Id"
VERSION_HEADER = "X-Policy-Version"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_BODY_BYTES = 64 << 20
"""A long agent conversation resent on every call outgrows aiohttp's 1 MiB default."""
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
    if body.get("stream"):
        raise BadRequest("stream", "streaming is not supported: set 'stream' to false")
    if body.get("n") not in (None, 1):
        raise BadRequest("n", "only n=1 is served")
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
    """

    def __init__(
        self, engine: Engine, renderer: ChatRenderer, sampling: SamplingSpec, max_model_len: int, model_name: str
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.capture = EpisodeCapture(renderer)
        self.url: str | None = None
        self.calls = 0
        self._ids = itertools.count()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._runner: web.AppRunner | None = None
        self.guard = Guard("127.0.0.1", "")
        self.max_body_bytes = MAX_BODY_BYTES
        self.api_key = ""
        """The key a client sends ("" = none asked); the agent harness's client uses it."""

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
        await web.TCPSite(self._runner, host, port).start()
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

    def stats(self) -> dict[str, int]:
        return {
            "openai_calls": self.calls,
            "openai_drift": self.capture.drifts,
            "openai_open_episodes": len(self.capture.episodes),
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

    async def _chat(self, http: web.Request) -> web.Response:
        try:
            payload = await http.json()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, None, f"the request body is over {self.max_body_bytes} bytes")
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
            return _error(400, None, f"the request body is not JSON: {type(e).__name__}: {str(e)[:200]}")
        try:
            request = parse_chat_request(payload)
            episode_id = http.headers.get(EPISODE_HEADER) or request.user
            if episode_id is None:
                body = await self.complete(request, None)
            else:
                async with self._locks[episode_id]:
                    body = await self.complete(request, episode_id)
        except BadRequest as e:
            return _error(400, e.param, str(e))
        except EngineFailure as e:
            return _error(503, None, str(e), kind="server_error")
        return web.json_response(body, headers={VERSION_HEADER: str(body["policy_version"])})

    # ---------------------------------------------------------------------------------------------
    # Completion

    async def complete(self, request: ChatRequest, episode_id: str | None) -> dict[str, Any]:
        """Serve one checked request; with an episode id, capture it. Returns the response body."""
        try:
            rendered = self.renderer.render(request.messages, request.tools, tool_choice=request.tool_choice)
        except Exception as e:  # the template rejected the conversation (a missing field, a role it refuses)
            raise BadRequest(
                "messages", f"the chat template cannot render these messages: {type(e).__name__}: {e}"
            ) from e
        plan = self.capture.plan(episode_id, rendered)
        room = self.max_model_len - len(plan.prompt_ids)
        if room < 1:
            raise BadRequest(
                "messages",
                f"the prompt is {len(plan.prompt_ids)} tokens; this engine serves {self.max_model_len} in all",
            )
        tops: list[dict[int, float]] = []
        completion = await self._generate(plan.prompt_ids, self._spec(request, room), episode_id, tops)
        visible = _stop_cut(self.renderer.decode(completion.response_ids), request.stop)
        turn = SampledTurn(rendered, self.renderer.decode(completion.response_ids, specials=True), visible)
        if episode_id is not None:
            self.capture.record(episode_id, plan, completion, visible)
        self.calls += 1
        return self._body(request, completion, assistant_message(turn, self.renderer, request), tops, episode_id)

    def _spec(self, request: ChatRequest, room: int) -> SamplingSpec:
        base = self.sampling
        return dataclasses.replace(
            base,
            max_tokens=min(request.max_tokens or base.max_tokens, room),
            temperature=base.temperature if request.temperature is None else float(request.temperature),
            top_p=base.top_p if request.top_p is None else float(request.top_p),
            stop=request.stop,
            top_logprobs=request.top_logprobs,
            seed=request.seed,
            ignore_eos=False,
        )

    async def _generate(
        self, prompt_ids: list[int], spec: SamplingSpec, episode_id: str | None, tops: list
    ) -> Trajectory:
        n = next(self._ids)
        prompt = Prompt(prompt_id=f"openai-{n}", prompt_ids=prompt_ids, ground_truth="")
        request = Request(
            request_id=f"openai/{episode_id or '-'}/{n}",
            group_id=episode_id or f"openai-{n}",
            sample_index=0,
            group_size=1,
            prompt=prompt,
        )
        completion = await self.engine.generate(request, spec, top_logprobs=tops)
        if completion.failed:
            raise EngineFailure(f"generation failed: {completion.failure}")
        return completion

    def _body(
        self, request: ChatRequest, completion: Trajectory, message: dict[str, Any], tops: list, episode_id: str | None
    ) -> dict[str, Any]:
        finish = "tool_calls" if "tool_calls" in message else completion.finish_reason
        prompt_tokens, completion_tokens = len(completion.prompt_ids), len(completion.response_ids)
        return {
            "id": f"chatcmpl-{completion.prompt_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": {"content": self._logprobs(completion, tops)} if request.logprobs else None,
                    "token_ids": completion.response_ids.tolist(),
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "prompt_token_ids": completion.prompt_ids.tolist(),
            "policy_version": completion.max_version,
            "episode_id": episode_id,
        }

    def _logprobs(self, completion: Trajectory, tops: list[dict[int, float]]) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.renderer.decode([token_id], specials=True)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        # strict: the engine reports the alternatives of every position it sampled
        return [
            {
                **entry(int(t), float(lp)),
                "top_logprobs": [entry(a, b) for a, b in sorted(top.items(), key=lambda kv: -kv[1])],
            }
            for t, lp, top in zip(completion.response_ids, completion.rollout_logprobs, tops, strict=True)
        ]


class EngineFailure(RuntimeError):
    """The engine did not finish the generation (timeout, abort, error): a 503 the harness may retry."""


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
    server = OpenAIServer(engine, ChatRenderer(tokenizer, template), sampling, max_model_len, Path(model_dir).name)
    api_key = secret(rollout.openai_api_key, OPENAI_API_KEY_ENV)
    await server.start(rollout.openai_host, port_for(rollout.openai_port, worker_name), api_key)
    return server
