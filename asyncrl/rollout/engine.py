"""`Engine`: one vLLM `AsyncLLM` behind the small async interface a rollout worker needs.

Usable directly (tests, scripts under a `__main__` guard) or inside the `RolloutWorker` Ray actor. All
vLLM-specific workarounds live in `vllm_compat`; this module only drives the public `AsyncLLM` API.

Versions: the engine starts at `initial_version`. `update_weights(..., in_flight=True)` pauses the scheduler
without dropping running requests, loads the buckets, relabels the engine's weight version and resumes;
tokens a running request produces after the update carry the new version (vLLM reports per-token weight
version spans), and their KV cache of earlier tokens is the one computed by the old weights (as in
PipelineRL). `in_flight=False` lets running requests finish before loading (the on-policy variant).

The G samples of a group, started together with the same prompt and sampling, go to vLLM as one request with
`n = G` (the prompt is processed once); vLLM 0.32 runs it as child requests, and one member is aborted (stale,
timeout, cancelled) by its child's internal id (`vllm_compat.child_request_id`) while its siblings go on.
A retried member (a new attempt) comes alone and runs as a request of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asyncrl.rollout import vllm_compat
from asyncrl.rollout.sampling import (
    GREEDY_BELOW,
    EvalResult,
    Member,
    SamplingSpec,
    Stream,
    finish_reason,
    shared_spec,
    vllm_sampling_params,
)
from asyncrl.rollout.vllm_compat import EngineStartError
from asyncrl.staleness import Staleness
from asyncrl.types import STALE_FAILURE, Prompt, Request, Trajectory
from asyncrl.weights.adapter import AdapterWeights

__all__ = ["Engine", "EngineStartError", "EvalResult", "SamplingSpec"]

WARM_UP_REQUESTS = 32
"""Requests `Engine.start` runs before serving (see `Engine._warm_up`)."""
WARM_UP_TOKENS = 512
"""The longest of them, in generated tokens (capped by the context)."""


class Engine:
    """An in-process vLLM engine: generate trajectories, score sequences, load new weights."""

    def __init__(
        self,
        model_dir: str,
        *,
        name: str = "engine",
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        initial_version: int = 0,
        weight_load: str = "auto",
        group_requests: bool = True,
        fork_core: bool = True,
        lora_rank: int | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.name = name
        self._engine_kwargs: dict[str, Any] = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            lora_rank=lora_rank,
        )
        self._kv_cache_gib = kv_cache_gib
        self._version = initial_version
        self._weight_load = weight_load
        """`RolloutConfig.weight_load` (auto / in_place / reload)."""
        self._group_requests = group_requests
        """Samples of one prompt and sampling asked for in one event-loop turn share a vLLM request (`_submit`)."""
        self._fork_core = fork_core
        """Fork vLLM's engine core from a preloaded server on CPU (`RolloutConfig.fork_engine_core`)."""
        self._lora: Any = None
        """The `LoRARequest` every request names once an adapter was loaded (`learner.lora`; `_load_adapter`);
        None: the base model (version 0 of a LoRA run: its adapters start at B = 0)."""
        self._adapter_dir: str | None = None
        """This engine's adapter folder, made on the first adapter load and removed at shutdown."""
        self._in_place = False
        """Whether new weights are copied into the parameters (decided at start) or go through vLLM's reload."""
        self._llm: Any = None
        self._tokenizer: Any = None
        self._update_lock = asyncio.Lock()
        self._group_key = _group_key(name)
        """This engine's process group with learner rank 0 (the collective transport); renewed after a failure."""
        self._ids = itertools.count()
        self._progress: dict[str, int] = {}
        self._running: dict[str, Member] = {}
        """`Request.request_id` -> its running sample."""
        self._pending: dict[tuple[tuple[int, ...], SamplingSpec], list[Member]] = {}
        """Samples asked for in this event-loop turn, by prompt ids and sampling (`_submit`)."""
        self._abort_reasons: dict[str, str] = {}
        self.num_tokens_generated = 0
        self.num_requests_done = 0
        self.num_vllm_requests = 0
        """Requests sent to vLLM for samples (`generate`): one per group started together, not one per sample."""
        self.frozen_objects = 0
        """Objects of this process's start-up heap taken out of the garbage collector's reach at start
        (`vllm_compat.freeze_startup_heap`)."""

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    async def start(self) -> None:
        """Start the vLLM engine and warm it up. An engine that dies meanwhile raises `EngineStartError` carrying
        vLLM's own error, read back from the output its engine core shares with this process."""
        with vllm_compat.start_failures_explained():
            await self._start()

    async def _start(self) -> None:
        vllm_compat.configure_process_env(self._kv_cache_gib)
        fork = self._fork_core and vllm_compat.cpu_build()
        if fork:
            vllm_compat.start_engine_core_server()  # imports vLLM's engine core while this process imports vLLM
        args = vllm_compat.engine_args(self.model_dir, **self._engine_kwargs)
        self._llm = vllm_compat.create_async_llm(args, fork_core=fork)
        self._tokenizer = self._llm.tokenizer
        if self._weight_load != "reload" and self._engine_kwargs["lora_rank"] is None:
            # A LoRA engine's layers wrap their base weights (`base_layer`), which stay as loaded: nothing to unpack.
            self._in_place = await vllm_compat.prepare_in_place(self._llm, self._weight_load == "auto")
        await vllm_compat.set_weight_version(self._llm, self._version)
        await self._warm_up()
        self.frozen_objects = vllm_compat.freeze_startup_heap()

    async def _warm_up(self) -> None:
        """Pay vLLM's one-off costs here, before serving, so that request timeouts, the pool's readiness and the
        first training steps mean what they say: the first request (~7 s on a 2-core CPU), and the first time
        each decode batch size and context length is met (the first W2 batch took 3.8 s cold against 0.3 s
        warm; the 24 W2 batches 14.9 s against 9.2 s). `WARM_UP_REQUESTS` requests of staggered lengths, up to
        `WARM_UP_TOKENS` or the context, sampled with log-probs as rollouts are, meet every decode batch size
        from that many down to one and contexts up to the longest (~4 s here, once per engine)."""
        bos = self._tokenizer.bos_token_id or 0
        longest = max(1, min(WARM_UP_TOKENS, self._llm.model_config.max_model_len - 1))
        n = max(1, min(WARM_UP_REQUESTS, self._engine_kwargs["max_num_seqs"]))

        async def one(i: int) -> None:
            spec = SamplingSpec(max_tokens=max(1, longest * (i + 1) // n), temperature=1.0, ignore_eos=True)
            async for _ in self._llm.generate(
                vllm_compat.token_input([bos]), self._sampling_params(spec), f"warm-up#{next(self._ids)}"
            ):
                pass

        await asyncio.gather(*(one(i) for i in range(n)))

    @property
    def weight_load(self) -> str:
        """How this started engine takes new weights: `in_place` or `reload` (what `auto` became)."""
        return "in_place" if self._in_place else "reload"

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
            vllm_compat.unfreeze_heap()
        if self._adapter_dir is not None:
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    @property
    def version(self) -> int:
        return self._version

    @property
    def started(self) -> bool:
        return self._llm is not None

    def running(self) -> dict[str, int]:
        """Tokens received so far per running request, by `Request.request_id`."""
        return dict(self._progress)

    def progress(self, request_id: str) -> int:
        """Tokens received so far for a running request, by `Request.request_id` (0 once finished or unknown)."""
        return self._progress.get(request_id, 0)

    # ---------------------------------------------------------------------------------------------
    # Generation

    def _sampling_params(self, spec: SamplingSpec, **options: Any) -> Any:
        """`sampling.vllm_sampling_params`: fresh vLLM parameters for exactly one request (a method, so that a
        benchmark can swap the layout per engine class: benchmarks/logprob_layout.py)."""
        return vllm_sampling_params(spec, **options)

    async def generate(
        self,
        request: Request,
        sampling: SamplingSpec,
        top_logprobs: list[dict[int, float]] | None = None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
    ) -> Trajectory:
        """Run one request to completion (or to its timeout) and return its trajectory. `top_logprobs`, when
        given, receives each position's `sampling.top_logprobs` most likely tokens and their log-probs (filled
        as tokens arrive); `on_tokens`, when given, is told each batch of new tokens and their log-probs as vLLM
        hands it over (vLLM's per-step delta outputs), before the request finishes.

        Requests for the same prompt ids with the same sampling made in one event-loop turn (the members of a
        group the worker starts together) travel to vLLM as one request with `n` samples (`_submit`); each
        still has its own timeout, stale abort and cancellation, and comes back as its own trajectory."""
        self._require_started()
        prompt: Prompt = request.prompt
        dispatch_version = self._version
        submitted_at = time.time()
        member = Member(request, top=top_logprobs, top_k=sampling.top_logprobs, on_tokens=on_tokens)
        failure: str | None = None
        self._progress[request.request_id] = 0
        self._running[request.request_id] = member
        try:
            # vLLM refuses n > 1 with greedy sampling; a seed or top log-probs belong to one sample.
            shareable = (
                self._group_requests
                and sampling.temperature >= GREEDY_BELOW
                and sampling.seed is None
                and top_logprobs is None
            )
            self._submit(member, prompt.prompt_ids, sampling, shareable)
            async with asyncio.timeout(sampling.timeout_s):  # `wait_for` would start a task per sample
                await member.done.wait()
        except TimeoutError:
            failure = f"timeout: request {request.request_id} ran longer than {sampling.timeout_s}s"
            # An external abort makes vLLM emit a final "abort" output, so the member ends with its partial response.
            await self._abort([member])
            try:
                await asyncio.wait_for(member.done.wait(), timeout=5.0)
            except TimeoutError:
                self._leave(member)  # no final output came: stop waiting for it
            member.finish_reason = "abort"
        except asyncio.CancelledError:
            self._leave(member)
            raise
        finally:
            self._progress.pop(request.request_id, None)
            self._running.pop(request.request_id, None)
            abort_reason = self._abort_reasons.pop(request.request_id, None)
        if member.error is not None and failure is None:  # the engine died or rejected the request
            failure, member.finish_reason = member.error, "error"
        if abort_reason is not None and failure is None:
            failure, member.finish_reason = abort_reason, "abort"
        return self._trajectory(member, dispatch_version, submitted_at, failure)

    def _trajectory(
        self, member: Member, dispatch_version: int, submitted_at: float, failure: str | None
    ) -> Trajectory:
        request, prompt = member.request, member.request.prompt
        n = len(member.token_ids)
        self.num_tokens_generated += n
        self.num_requests_done += 1
        return Trajectory(
            prompt_id=prompt.prompt_id,
            group_id=request.group_id,
            sample_index=request.sample_index,
            prompt_ids=np.asarray(prompt.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(member.token_ids, dtype=np.int32),
            rollout_logprobs=np.asarray(member.logprobs[:n], dtype=np.float32),
            loss_mask=np.ones(n, dtype=np.int8),
            versions=vllm_compat.version_per_token(member.spans, n, dispatch_version),
            finish_reason=member.finish_reason,
            ground_truth=prompt.ground_truth,
            failure=failure,
            worker=self.name,
            attempt=request.attempt,
            dispatch_version=dispatch_version,
            submitted_at=submitted_at,
            finished_at=time.time(),
            response_text=self.decode(member.token_ids),
            routed_experts=None if member.routes is None else member.routes[: len(prompt.prompt_ids) + n],
        )

    # One vLLM request for the members of a group.

    def _submit(self, member: Member, prompt_ids: Sequence[int], sampling: SamplingSpec, shareable: bool) -> None:
        """Start `member`'s generation: alone, or (`shareable`) with the other members asking for the same
        prompt ids and sampling in this event-loop turn, as one `n`-sample request when the turn ends."""
        if not shareable:
            self._start_stream(prompt_ids, sampling, [member])
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._start_pending)
        self._pending.setdefault((tuple(prompt_ids), shared_spec(sampling)), []).append(member)

    def _start_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for (prompt_ids, sampling), members in pending.items():
            members = [m for m in members if not m.left]
            if members:
                self._start_stream(prompt_ids, sampling, members)

    def _start_stream(self, prompt_ids: Sequence[int], sampling: SamplingSpec, members: list[Member]) -> None:
        stream = Stream(f"{members[0].request.request_id}#{next(self._ids)}", members)  # unique inside vLLM
        self.num_vllm_requests += 1
        for index, member in enumerate(members):
            member.index, member.stream = index, stream
        stream.task = asyncio.ensure_future(self._consume(stream, list(prompt_ids), sampling))

    async def _consume(self, stream: Stream, prompt_ids: list[int], sampling: SamplingSpec) -> None:
        """Route the request's outputs to its members (by completion index) until every one finished; an
        engine that dies or rejects the request fails every member still running."""
        try:
            params = self._sampling_params(sampling, logprobs=sampling.top_logprobs, flat=True, n=len(stream.members))
            out_stream = self._llm.generate(
                vllm_compat.token_input(prompt_ids), params, stream.vllm_id, lora_request=self._lora
            )
            async for out in out_stream:
                for completion in out.outputs:
                    self._receive(stream.members[completion.index], completion)
        except Exception as e:
            for member in stream.members:
                if not member.done.is_set():
                    member.error = f"engine_error: {type(e).__name__}: {e}"
        finally:
            for member in stream.members:
                member.done.set()

    def _receive(self, member: Member, completion: Any) -> None:
        rid = member.request.request_id
        new = list(completion.token_ids)
        if new and rid in self._progress:
            if not member.token_ids:
                # The first token was sampled with weights no newer than those served now: an upper bound on
                # the trajectory's min_version (the label changes only while paused).
                member.first_version = self._version
            member.token_ids.extend(new)
            logprobs = vllm_compat.sampled_logprobs(completion.logprobs, new)
            member.logprobs.extend(logprobs)
            if member.top is not None:
                member.top.extend(vllm_compat.top_logprobs(completion.logprobs, member.top_k))
            self._progress[rid] = len(member.token_ids)
            if member.on_tokens is not None:
                member.on_tokens(new, list(logprobs))
        if completion.finish_reason is not None:
            member.spans = completion.weight_versions
            member.routes = vllm_compat.routed_experts(completion)
            member.finish_reason = finish_reason(completion.finish_reason)
            member.done.set()

    async def _abort(self, members: Sequence[Member]) -> None:
        """Abort these members' samples in vLLM (which then emits each one's final "abort" output), their
        siblings in an `n`-sample request going on."""
        whole, children = [], []
        for member in members:
            stream = member.stream
            if stream is None or member.done.is_set():
                continue
            if len(stream.members) == 1:
                whole.append(stream.vllm_id)
            elif (child := vllm_compat.child_request_id(self._llm, stream.vllm_id, member.index)) is not None:
                children.append(child)
        if whole:
            await self._llm.abort(whole)
        if children:
            await self._llm.abort(children, internal=True)

    def _leave(self, member: Member) -> None:
        """`member`'s caller was cancelled: end its sample; the whole request once no member waits for it."""
        member.left = True
        stream = member.stream
        if stream is None:
            return  # still pending: `_start_pending` skips it
        if all(m.left or m.done.is_set() for m in stream.members):
            if stream.task is not None:
                stream.task.cancel()  # vLLM aborts the request when its output stream is closed
        else:
            asyncio.ensure_future(self._abort([member]))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (an environment observation appended to an episode)."""
        self._require_started()
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def score(
        self, token_ids: Sequence[int], prompt_len: int, sampling: SamplingSpec | None = None
    ) -> np.ndarray:
        """log p(token_ids[t] | token_ids[:t]) for t >= prompt_len under the engine's current weights, float32
        [len - prompt_len]. `sampling` None: the raw distribution (temperature 1; vLLM's prompt log-probs skip
        every sampling processor). Otherwise the processed distribution of `sampling` (temperature, top-k,
        top-p), -inf for a token outside its kept set: what rollout log-probs under `sampling` refer to."""
        self._require_started()
        if not 1 <= prompt_len < len(token_ids):
            raise ValueError(f"prompt_len must be in [1, {len(token_ids)}) (got {prompt_len})")
        if sampling is not None:
            positions = range(prompt_len, len(token_ids))
            scored = await asyncio.gather(
                *(self._processed_logprob(token_ids[:t], token_ids[t], sampling) for t in positions)
            )
            return np.asarray(scored, dtype=np.float32)
        params = self._sampling_params(SamplingSpec(max_tokens=1, temperature=1.0), logprobs=None, prompt_logprobs=0)
        request_id = f"score#{next(self._ids)}"
        prompt_logprobs = None
        async for out in self._llm.generate(
            vllm_compat.token_input(list(token_ids)), params, request_id, lora_request=self._lora
        ):
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs  # position 0 is None: nothing predicts the first token
        if prompt_logprobs is None:
            raise RuntimeError(f"engine {self.name}: vLLM returned no prompt log-probs for {request_id}")
        return np.asarray(
            [float(prompt_logprobs[t][token_ids[t]].logprob) for t in range(prompt_len, len(token_ids))],
            dtype=np.float32,
        )

    async def _processed_logprob(self, prefix: Sequence[int], target: int, sampling: SamplingSpec) -> float:
        """The processed log-prob of `target` after `prefix`: one one-token request that asks for it by id
        (vLLM `logprob_token_ids`, processed like sampled tokens' log-probs), whatever token it samples."""
        spec = dataclasses.replace(sampling, max_tokens=1, ignore_eos=True, timeout_s=None)
        params = self._sampling_params(spec, logprobs=None, logprob_token_ids=[int(target)])
        logprob = float("nan")
        request_id = f"score#{next(self._ids)}"
        async for out in self._llm.generate(
            vllm_compat.token_input(list(prefix)), params, request_id, lora_request=self._lora
        ):
            if out.outputs[0].logprobs:
                logprob = float(out.outputs[0].logprobs[0][int(target)].logprob)
        return logprob

    async def evaluate(
        self, prompts: Sequence[Prompt | Sequence[int]], max_tokens: int, temperature: float = 0.0, samples: int = 1
    ) -> list[EvalResult]:
        """`samples` completions per prompt at `temperature` (0 = greedy), one `EvalResult` per prompt, in order;
        a prompt's samples go to vLLM as one request of `n = samples` (its prompt is prefilled once). Greedy
        samples are one completion, repeated (vLLM takes no `n` > 1 at temperature 0)."""
        self._require_started()
        spec = SamplingSpec(max_tokens=max_tokens, temperature=temperature)
        n = samples if temperature > 0 else 1

        async def of_prompt(p: Prompt | Sequence[int]) -> EvalResult:
            ids = p.prompt_ids if isinstance(p, Prompt) else p
            params = self._sampling_params(spec, logprobs=None, n=n)
            dispatch_version = self._version
            tokens: list[list[int]] = [[] for _ in range(n)]
            reasons, spans = ["abort"] * n, [None] * n
            request_id = f"eval#{next(self._ids)}"
            out_stream = self._llm.generate(
                vllm_compat.token_input(list(ids)), params, request_id, lora_request=self._lora
            )
            async for out in out_stream:
                for completion in out.outputs:
                    tokens[completion.index].extend(completion.token_ids)
                    if completion.finish_reason is not None:
                        reasons[completion.index] = finish_reason(completion.finish_reason)
                        spans[completion.index] = completion.weight_versions
            versions = {dispatch_version}
            for sample, sample_spans in zip(tokens, spans, strict=True):
                versions.update(vllm_compat.version_per_token(sample_spans, len(sample), dispatch_version).tolist())
            texts = [self.decode(t) for t in tokens] * (samples // n)
            return EvalResult(
                texts=tuple(texts), finish_reasons=tuple(reasons * (samples // n)), versions=frozenset(versions)
            )

        return list(await asyncio.gather(*(of_prompt(p) for p in prompts)))

    # ---------------------------------------------------------------------------------------------
    # Weights

    async def update_weights(self, buckets: Sequence[Any], version: int, in_flight: bool = True) -> int:
        """Load weight buckets (safetensors bytes, or one `SharedWeights` / `CollectiveWeights` record; or one
        `AdapterWeights` record: the policy's LoRA adapter, `learner.lora`) and set the policy version; returns
        the number of tensors loaded (0 when the engine already serves a newer version: versions never go back).
        A collective pull may bring a newer version than `version` (the learner staged the next one first): the
        engine serves it under its own number.

        in_flight: running requests are frozen (not dropped) during the load and continue afterwards;
        their later tokens carry `version`. Otherwise running requests finish first. Either way no token
        is produced while weights are half loaded.
        """
        self._require_started()
        async with self._update_lock:
            if version < self._version:
                return 0  # a newer sync overtook this one (a joining worker gets both): the engine keeps the newer
            await vllm_compat.pause_for_update(self._llm, in_flight)
            try:
                if len(buckets) == 1 and isinstance(buckets[0], AdapterWeights):
                    num_tensors = await self._load_adapter(buckets[0])
                else:
                    num_tensors, version = await vllm_compat.load_weights(
                        self._llm, list(buckets), self._in_place, version, self._group_key
                    )
                await vllm_compat.set_weight_version(self._llm, version)
                self._version = version
            except Exception:
                self._group_key = _group_key(self.name)  # both sides dropped the group: the next pull opens another
                raise
            finally:
                await vllm_compat.resume_after_update(self._llm)
        return num_tensors

    async def _load_adapter(self, record: AdapterWeights) -> int:
        """Load the policy's LoRA adapter (`learner.lora`) in place (`vllm_compat.adapter`); every request names it
        from now on, those running included."""
        if self._adapter_dir is None:
            import tempfile

            self._adapter_dir = tempfile.mkdtemp(prefix=f"asyncrl-adapter-{self.name}-")
        num_tensors, self._lora = await vllm_compat.load_adapter(self._llm, record, self._adapter_dir)
        return num_tensors

    async def abort_stale(self, abort_after_lag: int) -> int:
        """Abort every running request that is certain to exceed the staleness bound `abort_after_lag` (η);
        returns how many.

        A request whose first token came back while the engine served version `f` has min_version <= f, and
        any learner step that could consume it runs at a version >= the one served now
        (`Staleness.certain_to_exceed`). A later call of a multi-turn episode is judged by the episode's oldest
        model token (`Member.oldest_version`), since its trajectory carries it. Its trajectory comes back with
        the partial response and `failure="stale: ..."` (`STALE_FAILURE`). Requests with neither a token yet
        nor an episode version are left alone.
        """
        self._require_started()
        bound = Staleness(abort_after_lag)
        doomed = [
            member
            for rid, member in self._running.items()
            if member.oldest_version is not None
            and bound.certain_to_exceed(member.oldest_version, self._version)
            and rid not in self._abort_reasons
        ]
        for member in doomed:
            self._abort_reasons[member.request.request_id] = (
                f"{STALE_FAILURE}: oldest token at version {member.oldest_version}, engine serves {self._version}, "
                f"max_staleness {abort_after_lag}"
            )
        # An abort makes vLLM emit the sample's final "abort" output: `generate` returns the partial response.
        await self._abort(doomed)
        return len(doomed)

    def _require_started(self) -> None:
        if self._llm is None:
            raise RuntimeError(f"engine {self.name} is not started (call `await engine.start()`)")


def _group_key(name: str) -> str:
    """A fresh process-group key: a group's rendezvous keys in the learner's store are never reused."""
    return f"{name}-{secrets.token_hex(4)}"
