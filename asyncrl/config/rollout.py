"""Sections of generation: the engines (`rollout`), the environment and reward (`env`), the tool workers (`tools`)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.cluster.http_guard import OPENAI_API_KEY_ENV, beyond_loopback_error, is_loopback, secret
from asyncrl.config.base import Section

WHOLE_SYSTEM_FOLDERS = ("/", "/etc", "/home", "/root", "/proc", "/sys", "/dev", "/run", "/tmp", "/var", "/usr")
"""Folders `tools.reward_mounts` may not name (each holds far more than one reward's data)."""


class AutoscaleConfig(Section):
    """Sizing the rollout pool from the run's live figures (`telemetry.rate_window_s`), between `min` and `max`
    engines, one engine at a time (docs/scaling.md#autoscaling)."""

    max: int = Field(0, ge=0, le=1024)
    """Most engines; 0: autoscaling off."""
    min: int = Field(1, ge=1, le=1024)
    """Fewest engines."""
    cooldown_s: float = Field(120.0, gt=0)
    """Seconds after a change (or the start) before the next: the new size's figures must fill the rate window."""
    sustain: int = Field(3, ge=1)
    """Consecutive pool snapshots (`telemetry.pool_every_s`) a condition must hold before it acts."""
    grow_learner_idle: float = Field(0.25, gt=0, le=1)
    """Grow when the learner waited for data at least this fraction of the window."""
    shrink_learner_idle: float = Field(0.05, ge=0, le=1)
    """Shrink only while the learner waited at most this fraction (below `grow_learner_idle`: hysteresis) ..."""
    shrink_ready_batches: float = Field(2.0, gt=0)
    """... and finished groups pile up: at least this many batches ready in the queue, ..."""
    shrink_rollout_idle: float = Field(0.5, gt=0, le=1)
    """... or the engines sat idle at least this fraction of the window: the queue holds new groups back while
    `buffer.max_ready_batches` batches are ready (1 by default, so ready groups alone rarely reach
    `shrink_ready_batches`) ..."""
    shrink_stale_fraction: float = Field(0.1, gt=0, le=1)
    """... or at least this fraction of the window's finished samples were dropped as stale."""
    request_resources: bool = True
    """Before growing on a cluster, ask Ray's autoscaler for the engines' bundles
    (`ray.autoscaler.sdk.request_resources`), so a node is added instead of the engine failing to be placed."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.max and self.min > self.max:
            raise ValueError(f"rollout.autoscale.min = {self.min} exceeds rollout.autoscale.max = {self.max}")
        if self.shrink_learner_idle >= self.grow_learner_idle:
            raise ValueError(
                f"rollout.autoscale.shrink_learner_idle = {self.shrink_learner_idle} must be below "
                f"grow_learner_idle = {self.grow_learner_idle} (hysteresis)"
            )
        return self


class RolloutConfig(Section):
    num_workers: int = Field(1, ge=1, le=1024)
    """Rollout engines (one vLLM engine per Ray actor). Independent of the learner pool size."""
    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """G: trajectories per prompt. 1 for `sao` (single rollout)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the learner divides logits by the same value (invariant 4)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (vLLM: after temperature and top-k, the least likely tokens whose total probability
    is at most 1 - top_p are dropped). Rollout log-probs are those of the processed (renormalised)
    distribution and the learner recomputes the same one (docs/algorithms.md#sampling-distribution)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (after temperature, before top-p); 0 = off. Like `top_p`, the
    learner scores the processed distribution; a token outside the learner's kept set leaves the loss."""
    max_tokens: int = Field(8, ge=1)
    """Maximum generated tokens per trajectory."""
    max_model_len: int = Field(512, ge=16)
    """Longest prompt + response an engine serves (sizes the KV cache). Each engine's start-up warm-up decodes up
    to it (at most 512 tokens): short prompts start faster with a smaller one (6.7 s against 2.3 s at 64, tiny
    model)."""
    weight_load: Literal["auto", "in_place", "reload"] = "auto"
    """How an engine takes a new policy version. `in_place`: each tensor is copied into the model's own
    parameters; on CPU vLLM's oneDNN-packed linear kernels are replaced by torch's `F.linear` on unpacked
    weights. `reload`: vLLM's layerwise `reload_weights`, which re-packs every linear layer. Measured on CPU
    (benchmarks/RESULTS.md, W3): in place syncs 125M parameters 2.3-3.2x faster (0.64-0.92 s -> 0.28 s) but
    decodes 32-34% slower at 25M-125M and 7% faster at 0.5M. `auto`: in place for hidden size <= 256, where
    the unpacked kernels decode at least as fast, else reload. Off CPU, and for quantized models, engines
    always reload."""
    max_requests_in_flight: int = Field(256, ge=1)
    """Requests an engine keeps running at once (continuous batching)."""
    group_requests: bool = True
    """The samples of a group that start together (same prompt, same sampling, handed out in one call) go to
    vLLM as one request with `n` samples: the prompt is processed once and the worker makes one request, not
    G (W1: 1.37x less rollout-worker CPU per trained sample, benchmarks/RESULTS.md). Each sample keeps its own tokens,
    log-probs, versions, timeout and abort. Off: one vLLM request per sample."""
    fork_engine_core: bool = True
    """With vLLM's CPU build, fork each engine's engine-core process from a server that imports vLLM while the
    worker does, instead of letting vLLM spawn it to import vLLM a second time (~8 s of a core): an engine
    serves 12.7 s after its actor starts instead of 18.7 on an idle 2-core machine, and a killed engine's
    replacement in a run 16.0 s instead of 20.2 (benchmarks/RESULTS.md, engine start-up). The server keeps
    ~0.2 GB per worker (the worker's processes: 2,265 against 2,055 MiB proportional set size). Off: vLLM's
    spawn. GPU builds always spawn."""
    request_timeout_s: float = Field(120.0, gt=0)
    """A request running longer is aborted and its trajectory counted `failed:timeout`."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory for an engine on GPU machines."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved by each rollout worker."""
    num_gpus_per_worker: float = Field(0.0, ge=0)
    """Ray GPUs reserved by each rollout worker (0 on CPU)."""
    engine_start_timeout_s: float = Field(300.0, gt=0)
    """A worker whose engine is not serving within this time is reported failed by name."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout worker's placement bundle asks for, e.g. `{rollout_node: 1}`: nodes
    started with `ray start --resources '{"rollout_node": 8}'` are the only ones that can host the pool."""
    replace_dead_workers: bool = True
    """A rollout worker that dies (while generating or loading weights) is replaced and its requests are
    re-dispatched; the run goes on and the learner does not wait for the replacement. False stops the run
    with an error naming the worker."""
    max_restarts_per_engine: int = Field(5, ge=0)
    """Replacements each engine slot may get in a run (a slot: an engine and the replacements that took its
    place); dead and hung engines both count. A slot past its budget is quarantined: not replaced again."""
    quarantine_failures: int = Field(3, ge=1)
    """An engine slot whose engines died or hung this many times within `quarantine_window_s` is crash-looping:
    it is quarantined before its budget is spent."""
    quarantine_window_s: float = Field(60.0, gt=0)
    """The window `quarantine_failures` counts in: a replacement takes ~16 s to serve on CPU, so 3 failures in 60 s
    mean each engine died within seconds of serving."""
    min_healthy_engines: int = Field(1, ge=0)
    """When quarantined slots leave fewer engines than this (serving or starting), the run stops at the next
    step boundary with a checkpoint, naming the quarantined engines. 0: go on while any engine serves."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Grow and shrink the pool from the learner's idle fraction and the queue's figures (`max` 0: off)."""
    heartbeat_timeout_s: float = Field(60.0, ge=1, le=3600)
    """A worker serving the queue that is alive but does not answer a ping within this (stopped, deadlocked) is
    killed and handled as a dead one (`replace_dead_workers`). Long enough for a busy engine to answer."""
    openai_port: int = Field(0, ge=-1, le=65535)
    """OpenAI-compatible endpoint per worker (docs/openai_endpoint.md): 0 = off, -1 = a free port per worker,
    N = port N + the worker's index. `RolloutPool.openai_urls()` lists the URLs."""
    openai_host: str = "127.0.0.1"
    """Address the endpoints listen on; the default keeps them reachable from this machine only. Beyond
    loopback the endpoints need `openai_api_key`."""
    openai_api_key: str = ""
    """API key the endpoints ask of every call (`Authorization: Bearer KEY`, the `openai` client's `api_key`);
    "" = the environment variable ASYNCRL_OPENAI_API_KEY (read where the worker runs), else none on loopback.
    Needed when `openai_host` is beyond loopback. Prefer the environment variable: a config value is a file's
    content."""
    openai_chat_template: str = ""
    """Template the endpoint renders conversations with: "" = the model's own, a shipped name (`default`, `chatml`,
    `llama3`, `gemma`; `qwen2_tools` = `chatml`) or a `.jinja` file (docs/tokenizers.md)."""
    openai_episode_ttl_s: float = Field(600.0, gt=0, le=86400)
    """An endpoint episode with no call for this long (never finished by its harness) is dropped, and counted in the
    worker's `openai_expired_episodes` stat; its calls are not trained."""
    openai_agent: str = ""
    """`module:function` agent harness run for each request instead of one generation (`asyncrl.rollout.openai_agent`):
    `async agent(client, prompt, episode) -> reward | (reward, info)`; needs `openai_port` != 0."""

    @model_validator(mode="after")
    def _min_healthy_fits(self) -> RolloutConfig:
        if self.min_healthy_engines > self.num_workers:
            raise ValueError(
                f"rollout.min_healthy_engines = {self.min_healthy_engines} exceeds rollout.num_workers = "
                f"{self.num_workers}: the run would stop at its first quarantined engine"
            )
        if self.autoscale.max and self.autoscale.min < self.min_healthy_engines:
            raise ValueError(
                f"rollout.autoscale.min = {self.autoscale.min} is below rollout.min_healthy_engines = "
                f"{self.min_healthy_engines}: the autoscaler would shrink the pool to a size the run refuses"
            )
        return self

    @model_validator(mode="after")
    def _exposed_endpoint_needs_a_key(self) -> RolloutConfig:
        if (
            self.openai_port
            and not is_loopback(self.openai_host)
            and not secret(self.openai_api_key, OPENAI_API_KEY_ENV)
        ):
            key, host = "rollout.openai_api_key", "rollout.openai_host"
            raise ValueError(beyond_loopback_error(key, OPENAI_API_KEY_ENV, host, self.openai_host))
        return self

    @model_validator(mode="after")
    def _agent_needs_endpoint(self) -> RolloutConfig:
        if self.openai_agent and self.openai_port == 0:
            raise ValueError(
                "rollout.openai_agent runs against the worker's endpoint: set rollout.openai_port (-1 = a free port)"
            )
        return self


class EnvConfig(Section):
    reward: str = "exact_match"
    """Reward function: a built-in name (`exact_match`) or `module:function` import path."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """A reward call running longer marks the trajectory `failed:reward_error` (timed out)."""
    name: str = "single_turn"
    """The environment that turns a prompt into an episode: a built-in (`single_turn`: one generation scored by
    `env.reward`; `calc`; `word_problems`) or a user class `package.module:Class` (docs/environments.md)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = Field(4, ge=1, le=1024)
    """Model turns per episode; an episode still going after this many ends `max_turns` (truncated)."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Prompt plus every turn and observation of an episode; more ends it `context` (truncated). None:
    `rollout.max_model_len`."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall time of one episode (turns and tool calls); past it the episode ends `timeout` (truncated)."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """One tool call running longer comes back to the model as a `timeout` tool error."""


class ToolsConfig(Section):
    """The sandboxed tool workers (asyncrl/envs/tools/pool.py): Ray actors that run the `python` tool and user
    rewards in a sandbox (asyncrl/envs/tools/sandbox.py, docs/tools.md), sized independently of the engines."""

    pool: Literal["auto", "on", "off"] = "auto"
    """`auto` starts the pool when the run needs it (a user `module:function` reward, or an environment that
    calls tools); `off` runs rewards in the rollout worker's process (a timed-out one cannot be killed)."""
    num_workers: int = Field(2, ge=1, le=1024)
    """Tool-worker actors (a tool call or reward goes to one of them; its sandboxed run is its own process)."""
    calls_per_worker: int = Field(4, ge=1, le=256)
    """Calls one tool worker runs at once (each in its own sandbox process); more wait their turn there."""
    reward_process_calls: int = Field(1024, ge=1)
    """Calls one sandboxed user-reward process serves (its module imported once) before a fresh one replaces it;
    1 = every call in its own process, for a reward that executes the model's answer (docs/tools.md)."""
    reward_batch: int = Field(32, ge=1, le=1024)
    """User reward calls waiting for a free call slot of a tool worker go to a reward process together, up to
    this many (each keeps its own limits)."""
    num_cpus_per_worker: float = Field(0.5, ge=0)
    """Ray CPUs reserved by each tool worker."""
    call_timeout_s: float = Field(10.0, gt=0)
    """Wall time of one tool call; past it the sandbox is killed and the call returns `timeout` to the model."""
    cpu_time_s: int = Field(5, ge=1)
    """CPU seconds one sandboxed run may use (RLIMIT_CPU)."""
    memory_mb: int = Field(1024, ge=64)
    """Address space of one sandboxed run in MiB (RLIMIT_AS)."""
    max_processes: int = Field(16, ge=1)
    """Processes and threads one sandboxed run may hold (RLIMIT_NPROC, under its own uid)."""
    tmp_mb: int = Field(8, ge=1)
    """Size of the run's private /tmp and its largest file (RLIMIT_FSIZE), in MiB."""
    output_bytes: int = Field(4096, ge=64)
    """stdout and stderr of a run are each cut to this many bytes before the model sees them."""
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    """A tool worker that does not answer the pool's heartbeat within this is killed and replaced."""
    max_restarts_per_worker: int = Field(5, ge=0)
    """Replacements each tool worker (by name) may get in a run, dead and hung alike; past it the worker is
    quarantined: not replaced, its calls go to the others."""
    min_healthy_workers: int = Field(1, ge=0)
    """When quarantined workers leave fewer tool workers than this, the run stops at the next step boundary with
    a checkpoint, naming them. 0: go on while any is left."""
    sandbox_uid_base: int = Field(200_000, ge=1000)
    """When running as root, each tool worker leases the first free block of 64 uids from here on its machine
    (a lock file per block in /tmp/asyncrl-sandbox-uids, released when the worker dies; a block that a live
    process still runs under is skipped) and gives each live process one of them (no account needed;
    asyncrl/envs/tools/sandbox.py). Runs that share a machine never share a uid."""
    reward_mounts: list[str] = Field(default_factory=list)
    """Host files or folders (absolute paths) that every sandboxed user-reward process also sees, read-only, at
    the same place: data a reward reads (a reference-answer folder). By default a reward sees only the code it
    imports (its module's package, asyncrl, site-packages) and never the run folder or the datasets;
    the `python` tool's programs never see these (docs/tools.md)."""

    @model_validator(mode="after")
    def _reward_mounts_exist(self) -> ToolsConfig:
        for raw in self.reward_mounts:
            path = os.path.realpath(raw) if os.path.isabs(raw) else ""
            if not path:
                raise ValueError(f"tools.reward_mounts: {raw!r} is not an absolute path")
            if path in WHOLE_SYSTEM_FOLDERS:
                raise ValueError(f"tools.reward_mounts: {raw!r} is a whole system folder; name what the reward reads")
            if not os.path.exists(path):
                raise ValueError(f"tools.reward_mounts: {raw!r} does not exist on this machine")
        return self

    @model_validator(mode="after")
    def _min_healthy_fits(self) -> ToolsConfig:
        if self.min_healthy_workers > self.num_workers:
            raise ValueError(
                f"tools.min_healthy_workers = {self.min_healthy_workers} exceeds tools.num_workers = "
                f"{self.num_workers}: the run would stop at its first quarantined tool worker"
            )
        return self
