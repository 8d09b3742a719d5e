"""`RolloutWorker`: one vLLM engine serving requests from the replay queue (an async Ray actor).

Each time slots are free the loop hands in the trajectories finished so far and takes requests for those
slots in one call, `queue.put_and_acquire(finished, name, free_slots)` (no requests back is back-pressure),
keeps up to `max_requests_in_flight` episodes running at once (vLLM batches their generations continuously),
and runs each as an environment episode (`EpisodeRunner`: one scored generation for the default
`single_turn`, model turns and tool observations for agent environments). Trajectories that finish while no
slot call comes (at stop, or while one is in flight) go back with `queue.put`, batched over a short window.
A reward that raises or runs past `env.reward_timeout_s` marks its trajectory `failure="reward_error: ..."`;
the worker keeps serving.

The class is plain Python so a test can drive it in-process; the pool runs it as `ray.remote(RolloutWorker)`.
Queue API used (the replay queue actor): `put_and_acquire(trajectories, worker, max_requests) -> Exchange`,
`put(trajectories) -> int`, `requeue_worker(worker) -> int` (called by the pool, not here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.config import EnvConfig, RolloutConfig
from asyncrl.envs.base import Env, EnvContext, is_multi_turn, make_env
from asyncrl.envs.episode import ChatTurns
from asyncrl.envs.rewards import resolve_reward
from asyncrl.envs.tools.base import InProcessTools, ToolExecutor
from asyncrl.rollout.engine import Engine, EvalResult, SamplingSpec
from asyncrl.rollout.episode_runner import EpisodeLimits, EpisodeRunner
from asyncrl.rollout.openai_server import OpenAIServer, start_worker_endpoint
from asyncrl.types import PackedTrajectories, Prompt, Request, Trajectory, WeightLoad

PUT_BATCH_WINDOW_S = 0.005
"""Trajectories finishing within this window of each other travel to the queue in one `put`."""
QUEUE_WAIT_S = 0.2
"""How long a slot call waits inside the queue for work when none is ready (back-pressure or empty): a long
poll, answered the moment admission opens (a new policy version, a new step's prompts), where sleeping between
calls would leave the engine idle for the rest of the sleep. Also the pause before retrying a failed hand-in."""
EMPTY_PAUSE_S = 0.01
"""Pause after a slot call came back empty, so a queue that answers at once cannot be polled in a tight loop."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a rollout worker needs to build its engine and serve; the pool builds it once from the run's config
    and sends the same typed record to every worker (only `seed` differs per worker)."""

    model_dir: str
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig.model_validate({}))
    env: EnvConfig = field(default_factory=lambda: EnvConfig.model_validate({}))
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    sampling: SamplingSpec | None = None
    """Overrides the sampling derived from `rollout` (e.g. `ignore_eos` for benchmarks)."""
    abort_after_lag: int | None = None
    """After each in-flight weight update, abort the running requests certain to exceed this staleness
    (`Engine.abort_stale`; `buffer.abort_after_lag`); None never aborts."""
    tools: ToolExecutor | None = None
    """Runs tools and the reward (asyncrl/envs/tools); None: in this process (`InProcessTools`)."""
    lora_rank: int | None = None
    """The engine serves the policy's LoRA adapter of this rank (`learner.lora`); None: the whole weights."""

    def build_engine(self, name: str) -> Engine:
        """The engine a worker named `name` serves with (not started)."""
        rollout = self.rollout
        return Engine(
            self.model_dir,
            name=name,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=rollout.max_requests_in_flight,
            kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            seed=self.seed,
            weight_load=rollout.weight_load,
            group_requests=rollout.group_requests,
            fork_core=rollout.fork_engine_core,
            lora_rank=self.lora_rank,
        )


@dataclass(frozen=True)
class EpisodeScore:
    """One held-out episode's outcome (`RolloutWorker.evaluate_episodes`)."""

    reward: float
    finish_reason: str
    num_turns: int
    tool_calls: int
    failure: str | None = None


class RolloutWorker:
    """Hosts one `Engine`; `run()` serves the queue until `stop()`.

    Args:
        name: the worker's name (`rollout-0`, ...); the queue tracks in-flight requests under it.
        spec: the engine, sampling, reward and staleness settings (`WorkerSpec`).
        queue: the replay queue actor handle (None: only score/evaluate/update_weights are used).
        engine: an already built engine (tests); by default one is built from `spec`.
    """

    def __init__(self, name: str, spec: WorkerSpec, queue: Any = None, *, engine: Engine | None = None) -> None:
        self.name = name
        self.spec = spec
        self.config = spec.rollout
        resolve_reward(spec.env.reward)  # fail at start, naming the reward, rather than on the first trajectory
        self.tools = spec.tools or InProcessTools()
        self.queue = queue
        self.sampling = spec.sampling or SamplingSpec.from_rollout_config(self.config)
        self.engine = engine or spec.build_engine(name)
        self.env_context = EnvContext(self.tools, spec.env.reward, spec.env.reward_timeout_s, spec.env.tool_timeout_s)
        self._make_env()  # fail at start, naming the environment, rather than on the first request
        chat = ChatTurns.for_model(spec.model_dir)
        if chat is not None and is_multi_turn(spec.env.name):
            chat.check()  # fail at start, naming the template, rather than at the first observation
        self.episodes = EpisodeRunner(self.engine, self._make_env, self._limits(), chat)
        self._start_lock = asyncio.Lock()
        self._running = False
        self._stopping = False
        self._run_exited = asyncio.Event()
        self._run_exited.set()
        self._in_flight: dict[str, asyncio.Task] = {}
        self._outbox: list[Trajectory] = []
        self._outbox_event = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._group_size = 1
        """The largest group seen in a hand-out (`_whole_group`)."""
        self._flusher: asyncio.Task | None = None
        # Accounting for stats(): busy = at least one generation running.
        self._run_started_at: float | None = None
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._reward_failures = 0
        self._trajectories_put = 0
        self._stale_aborts = 0
        self.openai: OpenAIServer | None = None
        """The OpenAI-compatible endpoint (`rollout.openai_port` != 0), started with the engine."""
        self.agent: Any = None
        """`OpenAIAgentEnv` when `rollout.openai_agent` names a harness: it serves the queue's requests."""

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    async def ready(self) -> dict[str, Any]:
        """Start the engine on first call; returns once it serves (the pool's health check)."""
        async with self._start_lock:
            if not self.engine.started:
                await self.engine.start()
                await self._start_openai()
        url = self.openai.url if self.openai is not None else None
        return {
            "name": self.name,
            "version": self.engine.version,
            "pid": os.getpid(),
            "openai_url": url,
            "weight_load": self.engine.weight_load,
        }

    async def _start_openai(self) -> None:
        if self.config.openai_port == 0:
            return
        max_len = self.spec.max_model_len or self.config.max_model_len
        self.openai = await start_worker_endpoint(
            self.engine, self.config, self.spec.model_dir, max_len, self.sampling, self.name
        )
        if self.config.openai_agent:
            from asyncrl.rollout.openai_agent import OpenAIAgentEnv, resolve_agent

            self.agent = OpenAIAgentEnv(
                resolve_agent(self.config.openai_agent), self.openai, self.config.request_timeout_s
            )

    async def run(self) -> dict[str, Any]:
        """Serve the queue until `stop()`; returns `stats()` at the end."""
        if self.queue is None:
            raise RuntimeError(f"{self.name}: run() needs a queue")
        if self._running:
            raise RuntimeError(f"{self.name}: run() is already running")
        await self.ready()
        self._running, self._stopping = True, False
        self._run_exited.clear()
        self._run_started_at = time.monotonic()
        self._flusher = asyncio.ensure_future(self._flush_loop())
        try:
            while not self._stopping:
                free_slots = self.config.max_requests_in_flight - len(self._in_flight)
                if free_slots <= 0 or (self._in_flight and free_slots < self._whole_group()):
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                requests = await self._hand_in_and_acquire(free_slots)
                if self._stopping:
                    break  # still charged to this worker by the queue: `requeue_worker` re-dispatches them
                if not requests:
                    await asyncio.sleep(EMPTY_PAUSE_S)
                    continue
                for request in requests:
                    self._group_size = max(self._group_size, request.group_size)
                    self._start_generation(request)
        finally:
            self._running = False
            self._run_exited.set()
        return self._stats()

    async def stop(self, drain: bool = False) -> int:
        """Stop taking requests. `drain`: let running generations finish and hand them in; otherwise abort
        them without handing them in (the pool re-dispatches them with `queue.requeue_worker`).
        Returns the number of requests dropped."""
        self._stopping = True
        self._slot_freed.set()
        # A `put_and_acquire` already in flight must come back before the pool re-queues this worker's requests.
        await self._run_exited.wait()
        tasks = list(self._in_flight.values())
        dropped = 0
        if drain:
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            for task in tasks:
                if not task.done():
                    task.cancel()
                    dropped += 1
            await asyncio.gather(*tasks, return_exceptions=True)
        self._in_flight.clear()
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        if self.queue is not None:
            await self._flush()
        self._mark_idle_if_empty()
        return dropped

    async def shutdown(self) -> None:
        await self.stop()
        if self.openai is not None:
            await self.openai.stop()
        await self.engine.shutdown()

    # ---------------------------------------------------------------------------------------------
    # Serving

    def _whole_group(self) -> int:
        """Free slots to wait for before asking for work while requests run: a whole group, so that the queue
        hands out groups whole (`ReplayQueueCore.acquire`) and each reaches vLLM as one request of n = G. A
        worker with fewer slots than a group asks for any free slot."""
        return self._group_size if self._group_size <= self.config.max_requests_in_flight else 1

    def _start_generation(self, request: Request) -> None:
        if not self._in_flight and self._busy_since is None:
            self._busy_since = time.monotonic()
        task = asyncio.ensure_future(self._rollout(request))
        self._in_flight[request.request_id] = task
        request_id = request.request_id
        task.add_done_callback(lambda _task: self._on_done(request_id))

    def _on_done(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)
        self._mark_idle_if_empty()
        self._slot_freed.set()

    def _mark_idle_if_empty(self) -> None:
        if not self._in_flight and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def _sampling_for(self, prompt: Prompt) -> SamplingSpec:
        """The worker's sampling with the prompt's overrides: `extra_info` keys `max_tokens` (int) and
        `ignore_eos` (bool) apply to this request only (benchmarks with per-request lengths)."""
        extra = prompt.extra_info or {}
        changes: dict[str, Any] = {}
        if "max_tokens" in extra:
            changes["max_tokens"] = int(extra["max_tokens"])
        if "ignore_eos" in extra:
            changes["ignore_eos"] = bool(extra["ignore_eos"])
        return dataclasses.replace(self.sampling, **changes) if changes else self.sampling

    def _make_env(self) -> Env:
        return make_env(self.spec.env.name, self.spec.env.kwargs, self.env_context)

    def _limits(self) -> EpisodeLimits:
        env = self.spec.env
        max_total = env.max_total_tokens or self.spec.max_model_len or self.config.max_model_len
        return EpisodeLimits(env.max_turns, max_total, env.episode_timeout_s)

    async def _rollout(self, request: Request) -> None:
        if self.agent is not None:  # an agent harness drove the episode through the OpenAI endpoint and scored it
            trajectory = await self.agent.rollout(request, self.name)
        else:
            trajectory = await self.episodes.run(request, self._sampling_for(request.prompt))
        if trajectory.failure is not None and trajectory.failure.startswith("reward_error"):
            self._reward_failures += 1
        self._outbox.append(trajectory)
        self._outbox_event.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._outbox_event.wait()
            await asyncio.sleep(PUT_BATCH_WINDOW_S)
            try:
                await self._flush()
            except Exception as e:
                print(f"[{self.name}] queue.put failed, will retry: {type(e).__name__}: {e}", flush=True)

    async def _flush(self) -> None:
        self._outbox_event.clear()
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            await self.queue.put.remote(PackedTrajectories(batch))
        except Exception:
            self._keep_for_next_flush(batch)
            await asyncio.sleep(QUEUE_WAIT_S)
            raise
        self._trajectories_put += len(batch)

    async def _hand_in_and_acquire(self, max_requests: int) -> list[Request]:
        """Hand in what finished and take up to `max_requests` requests in one queue call: a finished rollout
        frees the slot being filled, so a put and an acquire would mostly travel one right after the other.
        With nothing to hand out the queue holds the call up to `QUEUE_WAIT_S` (trajectories finishing
        meanwhile go by `_flush`)."""
        batch, self._outbox = self._outbox, []
        try:
            exchange = await self.queue.put_and_acquire.remote(
                PackedTrajectories(batch), self.name, max_requests, timeout_s=QUEUE_WAIT_S
            )
        except Exception:
            self._keep_for_next_flush(batch)
            raise
        self._trajectories_put += len(batch)
        return exchange.requests

    def _keep_for_next_flush(self, batch: list[Trajectory]) -> None:
        """A hand-in failed: keep its trajectories for the next one rather than lose them (the queue may be
        restarting)."""
        self._outbox = batch + self._outbox
        self._outbox_event.set()

    # ---------------------------------------------------------------------------------------------
    # Weights, probes, evaluation

    async def update_weights(self, bucket_refs: Sequence[Any], version: int, in_flight: bool = True) -> WeightLoad:
        """Load weights (object refs of safetensors bucket bytes, or the bytes); -> the version now served and
        when serving it began."""
        await self.ready()
        buckets = [await ref if not isinstance(ref, (bytes, bytearray, memoryview)) else ref for ref in bucket_refs]
        await self.engine.update_weights(buckets, version, in_flight=in_flight)
        load = WeightLoad(self.engine.version, time.time())
        if in_flight and self.spec.abort_after_lag is not None:
            self._stale_aborts += await self.engine.abort_stale(self.spec.abort_after_lag)
        return load

    async def score(self, token_ids: Sequence[int], prompt_len: int, processed: bool = False) -> np.ndarray:
        """Raw log-probs, or (`processed`) those of the distribution this worker samples from."""
        await self.ready()
        return await self.engine.score(token_ids, prompt_len, self.sampling if processed else None)

    async def evaluate(
        self,
        prompts: Sequence[Prompt | Sequence[int]],
        max_tokens: int | None = None,
        temperature: float = 0.0,
        samples: int = 1,
    ) -> list[EvalResult]:
        await self.ready()
        return await self.engine.evaluate(prompts, max_tokens or self.config.max_tokens, temperature, samples)

    async def evaluate_episodes(self, prompts: Sequence[Prompt], max_tokens: int | None = None) -> list[EpisodeScore]:
        """Greedy episodes of the environment, or of the agent harness (`rollout.openai_agent`), tools and all: one
        `EpisodeScore` per prompt, in order."""
        await self.ready()
        sampling = SamplingSpec(
            max_tokens=max_tokens or self.config.max_tokens, temperature=0.0, timeout_s=self.config.request_timeout_s
        )

        async def one(i: int, prompt: Prompt) -> EpisodeScore:
            request = Request(f"eval-episode/{i}/0", f"eval-episode-{i}", 0, 1, prompt)
            if self.agent is not None:  # the harness's episodes, served greedily
                t = await self.agent.rollout(request, self.name, greedy=True)
            else:
                t = await self.episodes.run(request, sampling)
            return EpisodeScore(t.reward, t.finish_reason, t.num_turns, t.tool_calls, t.failure)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def version(self) -> int:
        return self.engine.version

    async def finish_episode(self, episode_id: str, reward: float, **fields: Any) -> Trajectory:
        """Close an episode captured by this worker's OpenAI endpoint into one trajectory with `reward`; `fields`
        are further `Trajectory` fields (prompt_id and group_id default to the episode id)."""
        if self.openai is None:
            raise RuntimeError(f"{self.name}: no OpenAI endpoint (rollout.openai_port is 0)")
        captured = await self.openai.finish_episode(episode_id)
        fields = {"prompt_id": episode_id, "group_id": episode_id, "sample_index": 0, "worker": self.name, **fields}
        return captured.trajectory(reward=reward, **fields)

    async def stats(self) -> dict[str, Any]:
        """Counters for metrics: tokens generated, requests done, busy/idle seconds since `run()` began."""
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        now = time.monotonic()
        busy_s = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        elapsed_s = now - self._run_started_at if self._run_started_at is not None else 0.0
        return {
            "name": self.name,
            "version": self.engine.version,
            "running": self._running,
            "requests_in_flight": len(self._in_flight),
            "requests_done": self.engine.num_requests_done,
            "vllm_requests": self.engine.num_vllm_requests,
            "tokens_generated": self.engine.num_tokens_generated,
            "trajectories_put": self._trajectories_put,
            "reward_failures": self._reward_failures,
            "stale_aborts": self._stale_aborts,
            "busy_s": busy_s,
            "idle_s": max(0.0, elapsed_s - busy_s),
            **(self.openai.stats() if self.openai is not None else {}),
        }
