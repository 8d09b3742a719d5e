"""One typed config tree for a run.

Every component owns one section; a run is one `Config`. Loaded from YAML with `section.key=value`
overrides; unknown keys fail naming the key, the file and the closest valid name. Units are in the
names: `prompts_per_step`, `samples_per_prompt`, `max_staleness` (policy versions), `*_s` (seconds).

This module imports only pydantic and yaml so that `asyncrl --help` and `asyncrl check` stay fast.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.algo import names as algo_names
from asyncrl.algo import params as algo_params

RECIPES = Path(__file__).resolve().parent / "recipes"
"""The shipped recipes, package data of the wheel (`configs/` in the repository links here)."""
DEFAULT_CONFIG = RECIPES / "default.yaml"

Mode = Literal["sync", "streaming", "sao"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the file."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face model directory. When unset, the `preset` tiny model is built locally (and cached)."""
    preset: str = "add-1m"
    """Tiny Qwen2-architecture preset from `asyncrl.models` (used when `path` is unset)."""
    warm_start_examples: int = Field(2000, ge=0, le=100_000)
    """Supervised warm-start examples for the built-in task (0 = start from random weights). W1 allows at most
    2,000 (benchmarks: WORKLOADS W1). Without dropout, 20,000 seen ~2.4 times gave a start RL lifts further
    than 2,000 seen ~15 times: +0.40 in 200 plain-loop steps against +0.26 (seed 0; seed 1 on 20,000 gained
    +0.20): the `add_20k` recipe. Within 2,000, `warm_start_dropout` does it (issue #18, models/warm_start.py)."""
    warm_start_epochs: int = Field(40, ge=0, le=1000)
    """Upper bound on epochs of the supervised warm start (it stops earlier once `warm_start_target` is met)."""
    warm_start_lr: float = Field(1e-3, gt=0)
    """Learning rate of the supervised warm start (linear warm-up over 50 steps, then constant)."""
    warm_start_target: float | None = Field(0.2, gt=0, le=1)
    """Stop the warm start once greedy accuracy on 200 validation prompts (disjoint from the held-out set)
    reaches this (checked every 25 steps). `add`'s learning curve is so sharp (validation 0.125 -> 0.300 within
    50 steps on 20,000 examples; 2,000 examples: held-out 0.18 -> 0.39 between epochs 14 and 17) that a fixed
    epoch count may land anywhere on it on a CPU whose kernels round differently; a target does not. With 0.2 the
    check first passes at 0.250 on 2,000 examples with dropout 0.2 (0.202 held-out, 26 epochs; without dropout
    0.315, 0.312 held-out, 14.7 epochs), at 0.300 on 20,000 (0.226 held-out, 2.36 epochs). None = run all epochs."""
    warm_start_dropout: float = Field(0.2, ge=0, lt=1)
    """Attention dropout during the `add` warm start (the saved model has none). It is what makes W1's
    2,000-example start one RL can lift (issue #18): at the same validation target, 0.2 gave a start the plain
    GRPO loop lifts +0.47 in 200 steps, against +0.26 without (asyncrl/models/warm_start.py; seed 0). Dropout
    delays the supervised transition: a start that has not met `warm_start_target` within `warm_start_epochs`
    is trained again from its initial weights without dropout (as seeds 1 and 2 are). 0 = none."""
    warm_start_tool_fraction: float = Field(0.3, ge=0, le=1)
    """`calc` task: fraction of warm-start examples that call the calculator (the rest answer in the head);
    the `calc` warm start runs `warm_start_epochs` epochs (no accuracy target)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the learner's decoder layers and weight dtype of the engines. With `bfloat16` the
    learner keeps fp32 master weights, optimizer state, gradient reductions and head (FSDP2 mixed
    precision, or its casts without FSDP on one rank; docs/algorithms.md#mixed-precision) and sends the
    engines bf16 roundings of its weights. fp32 gives 1e-5 log-prob parity on CPU."""


class DataConfig(Section):
    task: Literal["add", "parquet", "calc", "word_problems"] = "add"
    """`add` generates the W1 task; `parquet` reads verl-layout files from `train_path` / `eval_path`; `calc`
    (multi-operand sums to solve with the calculator) and `word_problems` (templated arithmetic stories) are
    generated locally for the agent environments (docs/environments.md)."""
    train_path: str | None = None
    """Parquet file of training prompts (verl column layout) when `task: parquet`."""
    eval_path: str | None = None
    """Parquet file of held-out prompts when `task: parquet`."""
    eval_prompts: int = Field(500, ge=1)
    """Number of held-out prompts used for evaluation."""
    max_operand: int = Field(999, ge=1)
    """Largest operand of the `add` task (operands are uniform in [0, max_operand])."""
    operands: int = Field(3, ge=2, le=8)
    """Operands of one `calc` problem (each a 3-digit number)."""
    seed: int = 0
    """Seed of the prompt stream; the held-out set uses its own fixed seed."""


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
    to it (at most 512 tokens): short prompts start faster with a smaller one (6.7 s against 2.3 s at 64, tiny model)."""
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
    openai_port: int = Field(0, ge=-1, le=65535)
    """OpenAI-compatible endpoint per worker (docs/openai_endpoint.md): 0 = off, -1 = a free port per worker,
    N = port N + the worker's index. `RolloutPool.openai_urls()` lists the URLs."""
    openai_host: str = "127.0.0.1"
    """Address the endpoints listen on; the default keeps them reachable from this machine only."""
    openai_chat_template: str = ""
    """Template the endpoint renders conversations with: "" = the model's own, a shipped name (`default`,
    `qwen2_tools`) or a `.jinja` file."""
    openai_agent: str = ""
    """`module:function` agent harness run for each request instead of one generation (`asyncrl.rollout.openai_agent`):
    `async agent(client, prompt, episode) -> reward | (reward, info)`; needs `openai_port` != 0."""

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
    sandbox_uid_base: int = Field(200_000, ge=1000)
    """When running as root, each tool worker leases the first free block of 64 uids from here on its machine
    (a lock file per block in /tmp/asyncrl-sandbox-uids, released when the worker dies; a block that a live
    process still runs under is skipped) and gives each live process one of them (no account needed;
    asyncrl/envs/tools/sandbox.py). Runs that share a machine never share a uid."""


class BufferConfig(Section):
    max_staleness: int = Field(4, ge=0, le=1024)
    """eta: the largest policy lag (learner version minus a sample's min_version) allowed in a gradient."""
    stale_policy: Literal["drop", "wait", "continue"] = "wait"
    """What happens to a sample that would outlive `max_staleness`. `wait` (default): nothing is aborted or dropped
    for staleness; the learner's next step waits until every group for which that step is the last one within the
    bound (started at admission version <= learner version - max_staleness) is ready, and trains the oldest groups
    first, so long samples are trained and the trained length distribution is the generated one. `drop`: such
    samples are aborted in flight (`abort_stale_in_flight`) or dropped at hand-out, so the learner never waits for
    them but trains a distribution biased to short samples. `continue` (partial rollouts): the sample keeps
    generating under each new policy version (its tokens carry the version and behaviour log-prob they were
    sampled with) and the learner never waits; at hand-out its tokens older than the bound are masked out of the
    loss (kept as context), so long samples are trained on their newer tokens. A group with a member that has no
    token left within the bound is dropped. Whichever policy, no trained token has lag > `max_staleness`."""
    abort_stale_in_flight: bool = True
    """Under `stale_policy: drop`, abort a running request as soon as it is certain to exceed `max_staleness` (its
    first token is more than `max_staleness` versions older than the weights its engine now serves): it ends
    `dropped_stale` with its group, and the engine's slot goes to new work instead of tokens that would be thrown
    away. Ignored under `wait` and `continue`, which abort nothing."""
    group_timeout_s: float = Field(120.0, gt=0)
    """A group whose members are not all in within this time after its first member is a straggler."""
    straggler_policy: Literal["drop", "partial"] = "drop"
    """`drop` the whole group, or train the finished members (`partial`, needs >= 2 members for group advantages)."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (their group advantage is 0). On by default; the `dapo`,
    `cispo` and `scalerl` presets ask for it too (`asyncrl.algo.names.PRESET_FILTERS`): an explicit value wins."""
    filter_overlong: bool = False
    """Drop trajectories truncated at `rollout.max_tokens`."""
    pass_rate_curriculum: bool = False
    """Retire prompts whose pass rate reached `pass_rate_threshold` (ScaleRL no-positive-resampling). The
    `scalerl` preset turns it on unless it is set explicitly (`asyncrl.algo.names.PRESET_FILTERS`)."""
    pass_rate_threshold: float = Field(0.9, gt=0, le=1)
    """Pass rate at which a prompt is retired (0.9 is ScaleRL's)."""
    capacity_groups: int = Field(1024, ge=1)
    """Ready groups held before producers are back-pressured."""
    max_ready_batches: int | None = Field(1, ge=1)
    """Stop starting groups while this many learner batches (B groups each) are ready and the learner's next
    step may take them (starts go on while that step waits for an unfinished old group, `stale_policy: wait`).
    η bounds how old a sample may be; this bounds how far generation runs ahead of a learner that cannot keep
    up, where finished samples would otherwise wait in the queue. 1 (default): on W1 streaming trained samples
    1.45 versions old instead of 3.1 at the same step time, and higher accuracy; on W2 streaming 1.09x the
    tokens/s and 2.6 instead of 3.2 (four rounds; on two shared cores an engine running ahead slows the
    learner). None: `max_staleness` and `capacity_groups` alone limit the lead, for engines with room to spare
    and long generations, where starting groups early hides their latency. docs/architecture.md#admission-control."""
    log_parquet: bool = True
    """Append every trajectory with its fate to `<run>/trajectories.parquet`."""

    @property
    def abort_staleness(self) -> int | None:
        """The staleness at which engines abort running requests (`Engine.abort_stale`); None = never."""
        return self.max_staleness if self.abort_stale_in_flight and self.stale_policy == "drop" else None


class AlgorithmConfig(Section):
    preset: str | None = "cispo"
    """A named recipe (grpo, dr_grpo, dapo, gspo, sapo, cispo, scalerl, dppo, gvpo, maxrl, rloo, reinforce_pp, ppo_gae, vapo, sao)."""
    advantage: str | None = None
    """Override the preset's advantage estimator."""
    loss: str | None = None
    """Override the preset's surrogate."""
    reduction: str | None = None
    """Override the preset's loss reduction."""
    correction: str | None = None
    """Override the preset's train-vs-rollout mismatch correction."""
    params: dict[str, float | int | bool | str | None] = Field(default_factory=dict)
    """Parameters of the recipe (e.g. eps_low, eps_high, tis_cap). A name that none of the chosen
    components takes, a wrong type or range, and eps_low/eps_high with CISPO's cap on are rejected
    (`asyncrl.algo.params` lists what each component takes)."""

    @model_validator(mode="after")
    def _known_names_and_params(self) -> AlgorithmConfig:
        for field, valid in (
            ("preset", algo_names.PRESETS),
            ("advantage", algo_names.ADVANTAGES),
            ("loss", algo_names.LOSSES),
            ("reduction", algo_names.REDUCTIONS),
            ("correction", algo_names.CORRECTIONS),
        ):
            value = getattr(self, field)
            if value is not None and value not in valid:
                raise ValueError(f"unknown {field} {value!r}{_did_you_mean(value, valid)}; valid: {', '.join(valid)}")
        if self.preset is None and None in (self.advantage, self.loss, self.reduction):
            raise ValueError("without a preset, set advantage, loss and reduction")
        algo_params.check_params(self.resolved_names(), self.params)
        return self

    def resolved_names(self) -> dict[str, str]:
        base = dict(algo_names.PRESET_COMPONENTS.get(self.preset or "", {}))
        for key in ("advantage", "loss", "reduction", "correction"):
            if getattr(self, key) is not None:
                base[key] = getattr(self, key)
        base.setdefault("correction", "none")
        return base


class LearnerConfig(Section):
    num_ranks: int = Field(1, ge=1, le=4096)
    """Learner processes forming one torch.distributed group (FSDP2; a single fp32 rank runs unwrapped). Independent of the rollout pool."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompt groups (or single trajectories in `sao`) consumed per optimizer step."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch over one rollout batch: its prompt groups are dealt in order into this
    many mini-batches of `prompts_per_step / mini_batches` whole groups. From the second update on the
    PPO ratio pi_theta / pi_old leaves 1, so clipping and DIS act. The policy version still advances
    once per rollout batch. Lower `lr` with it: each update is a full Adam step, so N updates of the same
    lr move the policy about N times as far per batch (W1, N = 4: the same lr learned less per sample than
    N = 1, lr / 4 learned at least as much; benchmarks/RESULTS.md)."""
    epochs: int = Field(1, ge=1)
    """Passes over the rollout batch's mini-batches (PPO epochs); updates per step = epochs x mini_batches."""
    kl_stop: float | None = Field(None, gt=0)
    """Stop the remaining updates of a step once a mini-batch's approx-KL(pi_old || pi_theta) (k3, mean
    over its loss tokens, measured before its update) exceeds this; None = never stop early."""
    tokens_per_microbatch: int = Field(4096, ge=1)
    """Token budget of one micro-batch (sequences are packed up to it)."""
    compile: bool = False
    """`torch.compile` the decoder layers of the policy (and the critic) for the passes with gradients, with dynamic
    shapes (one graph for every batch size and length); passes without gradients (pi_old, the parity probe) stay
    eager. The graphs are built during set-up, before the first rollout: ~10-40 s on a 2-vCPU host for a Qwen2
    layer (two ranks compile at once), more for larger models. In fp32 the gradients match the eager ones to
    float rounding, with FSDP2 too. Needs a C++ compiler where the learner runs (inductor); benchmarks/RESULTS.md
    has W1's step with and without it."""
    max_steps: int = Field(100, ge=0)
    """Learner steps of the run (one per rollout batch, whatever `mini_batches` and `epochs`)."""
    max_wall_s: float = Field(0.0, ge=0)
    """Stop after this many seconds (0 = no limit)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the policy."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps (learner steps: the schedule advances once per rollout batch)."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up, over the rest of `max_steps`: `constant`, or down from `lr` to
    `min_lr_ratio` x `lr` in a straight line (`linear`) or along a half cosine (`cosine`), reached after the
    last step. The critic's learning rate follows the same shape."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` decay end, as a fraction of `lr` (and of `critic_lr`)."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    critic: bool = False
    """Train a value head (needed by `gae`/`vapo` advantages, e.g. `sao` and `ppo_gae`)."""
    critic_lr: float = Field(1e-3, gt=0)
    """Learning rate of the value head."""
    critic_warmup_steps: int = Field(0, ge=0)
    """Value pre-training (VAPO): for the first N steps only the critic learns; the policy is not
    stepped (versions still advance so staleness accounting is unchanged)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl on GPU, gloo on CPU."""
    num_cpus_per_rank: float = Field(1.0, gt=0)
    """Ray CPUs reserved by each learner rank."""
    num_gpus_per_rank: float = Field(0.0, ge=0)
    """Ray GPUs reserved by each learner rank."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank's placement bundle asks for (pins the pool to nodes that have them)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the ranks' bundles share nodes (Ray placement group strategy): PACK keeps ranks together (fast
    collectives), SPREAD puts them on different nodes where it can."""
    max_skipped_steps: int = Field(3, ge=1)
    """A step whose loss or gradient is not finite is skipped (the weights and optimizer state stay as they
    were) and its batch kept in `<output_dir>/bad_batches/`; this many such steps in a row stop the run."""
    call_timeout_s: float = Field(900.0, gt=0)
    """Every call on the learner ranks (a step, an export, a checkpoint) must answer within this; otherwise the
    run stops with an error naming the rank and the call (a dead or hung rank never hangs the run)."""
    seed: int = 0
    """Seed of model init noise and micro-batch order."""

    @model_validator(mode="after")
    def _decay_needs_steps_after_warmup(self) -> LearnerConfig:
        if self.lr_decay != "constant" and self.max_steps <= self.warmup_steps:
            raise ValueError(
                f"lr_decay = {self.lr_decay!r} decays over the steps after the warm-up: max_steps "
                f"({self.max_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )
        return self


class WeightSyncConfig(Section):
    every_steps: int = Field(1, ge=1)
    """Publish weights after every k optimizer steps (a published step increments the policy version)."""
    bucket_bytes: int = Field(64 << 20, ge=1 << 16)
    """Weights travel in buckets of at most this many bytes."""
    timeout_s: float = Field(120.0, gt=0)
    """A sync not confirmed by every engine within this time fails naming the engine."""
    in_flight: bool = True
    """Update engines without draining running requests (their later tokens carry the new version)."""
    overlap: bool = True
    """With `in_flight` (streaming, sao): the learner starts its next step while the engines load; the next
    publication, evaluation or checkpoint first waits for the confirmation. At most one sync is in flight."""
    parity_probe: bool = True
    """Compare engine and learner log-probs on one fixed sequence after a sync (waits for that sync)."""
    parity_probe_every: int = Field(10, ge=1)
    """Probe after the first sync and after every k-th one."""
    transport: Literal["object_store", "shared_memory", "collective", "auto"] = "auto"
    """How weights reach the engines: `object_store` (safetensors buckets through Ray; any cluster),
    `shared_memory` (one segment in /dev/shm that every engine maps: every engine must run on the learner's
    node), `collective` (learner rank 0 broadcasts to each engine over its own torch.distributed group, in
    buckets of `bucket_bytes`: gloo on CPU, NCCL on GPU, where every engine needs a GPU the learner's rank 0
    does not use; any cluster), `auto` (shared memory on a single-node Ray cluster, else the object store)."""


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0)
    """Held-out evaluation period in optimizer steps (0 = only at start and end)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of evaluation (0 = greedy). No top-k / top-p: evaluation samples the policy's
    own distribution."""
    samples: int = Field(1, ge=1, le=1024)
    """Completions per held-out prompt. With k > 1 (needs `temperature` > 0) an evaluation reports mean@k
    (its `accuracy`) and pass@1..k (the unbiased estimator of Chen et al. 2021); a completion passes when
    its reward is >= 1."""

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> EvalConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"eval.samples = {self.samples} needs eval.temperature > 0: greedy decoding gives the same completion every time"
            )
        return self


class WandbConfig(Section):
    project: str
    """W&B project name."""
    mode: Literal["offline", "online"] = "offline"
    """`offline` writes the run under `<output_dir>/wandb` (upload later with `wandb sync`); `online` streams it."""


AlarmName = Literal["ess_fraction_below", "k3_above", "parity_above", "stale_drops_above", "learner_idle_above"]


class AlarmRule(Section):
    threshold: float
    """The figure's limit."""
    stop: bool = False
    """Crossing it also stops the run cleanly (checkpoint and summary; `stopped_early` names the alarm)."""


class TelemetryConfig(Section):
    log_every_steps: int = Field(1, ge=1)
    """Progress line period in optimizer steps."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus metrics on this port (0 = off)."""
    progress: bool = True
    """Print the progress line to the console."""
    pool_every_s: float = Field(5.0, gt=0)
    """Period of the live queue/engine/throughput snapshot sent to the telemetry sinks (seconds)."""
    dashboard_port: int = Field(8470, ge=0, le=65535)
    """Serve the run's dashboard page on this port (0 = off); when it is taken, a free port is used. The
    address is printed at start; `asyncrl dash RUN_DIR` opens the same page on a finished run."""
    bind_host: str = "127.0.0.1"
    """Address the dashboard and the Prometheus endpoint listen on; 127.0.0.1 keeps them on this machine,
    `0.0.0.0` exposes them to the network (a cluster scraper)."""
    tensorboard: bool = False
    """Also write the run's scalars as TensorBoard events under `<output_dir>/tensorboard` (extra `tensorboard`)."""
    wandb: WandbConfig | None = None
    """Also log the run's scalars to Weights & Biases (extra `wandb`): `{project: NAME, mode: offline | online}`;
    offline (the default mode) writes the run under `<output_dir>/wandb`, to upload later with `wandb sync`."""
    rate_window_s: float = Field(30.0, gt=0)
    """Live rates (tokens/s, busy and idle fractions, stale drops) are measured over the snapshots of this
    many recent seconds."""
    alarms: dict[AlarmName, AlarmRule] = Field(default_factory=dict)
    """Alarms, each `{threshold: x, stop: false}` (e.g. `telemetry.alarms.k3_above.threshold=0.01`), checked on
    every step, weight sync and pool snapshot: `ess_fraction_below` (normalised ESS of the step's IS weights
    pi_train / mu), `k3_above` (the step's k3 KL between learner and rollout log-probs), `parity_above` (max
    |engine - learner| log-prob of a probed sync), `stale_drops_above` (fraction of the samples finished in the
    last `rate_window_s` that were dropped as stale), `learner_idle_above` (fraction of the last `rate_window_s`
    the learner waited for data). A crossing logs a warning with the figure and the threshold, sets
    `asyncrl_alarm{name}` to 1 (0 once back within) and, with `stop: true`, ends the run with a checkpoint."""


class CheckpointConfig(Section):
    every_steps: int = Field(50, ge=0)
    """Checkpoint period in optimizer steps (0 = only at the end). A run killed between checkpoints resumes
    from the last one (`resume_from: latest`) with its version, counters and queue."""
    resume_from: str | None = None
    """A checkpoint folder to resume from, or `latest` for the newest in the output folder."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face safetensors folder (`final_model/`)."""
    export_best: bool = False
    """Also keep the best policy the run evaluated: each held-out evaluation that beats every earlier one
    exports it to `best_model/` (replacing it whole; `best_model/asyncrl_eval.json` names the evaluation).
    `summary.json`'s `best_eval` names the best evaluation either way."""


class ClusterConfig(Section):
    """How the pools are placed on a Ray cluster (each pool gets its own placement group)."""

    placement_timeout_s: float = Field(300.0, gt=0)
    """A pool whose placement group is not placed within this time fails, naming the pool, what its bundles
    ask for and what the cluster has free."""


class StorageConfig(Section):
    """Where a run's files go. Every node that writes them (the driver, learner rank 0, the replay queue)
    must see the same folder on a multi-node cluster."""

    uri: str | None = None
    """A folder every node mounts (NFS, a Kubernetes volume; `file://` URIs too): the run directory becomes
    `<uri>/<output_dir>` (checkpoints, final_model, metrics.jsonl, summary.json, trajectories). None = the
    local `output_dir`, as on one machine."""

    @model_validator(mode="after")
    def _filesystem_only(self) -> StorageConfig:
        scheme = self.uri.split("://", 1)[0] if self.uri and "://" in self.uri else None
        if scheme not in (None, "file"):
            raise ValueError(
                f"storage.uri {self.uri!r}: only mounted folders (a path or file://) are supported, not {scheme}://"
            )
        return self


class FaultsConfig(Section):
    """Fault injection for tests and soak runs: real processes are killed, nothing is mocked."""

    kill_rollout_worker_at_steps: list[int] = Field(default_factory=list)
    """After each of these optimizer steps, right after its weight sync starts (so the engine dies while it
    loads), SIGKILL the process of one rollout worker (the oldest)."""
    nan_reward_at_steps: list[int] = Field(default_factory=list)
    """Give one trajectory of the batch of each of these optimizer steps a NaN reward before the learner sees
    it (a broken reward path): the step must be skipped and the weights stay finite."""


class Config(Section):
    mode: Mode = "streaming"
    """`sync` (eta = 0 baseline), `streaming` (ScaleRL/PipelineRL), or `sao` (single rollout, critic, DIS)."""
    output_dir: str = "runs/default"
    """Folder for the resolved config, summary, logs and checkpoints of this run."""
    seed: int = 0
    """Global seed."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _preset_filters(self) -> Config:
        """The chosen preset's buffer filters become the defaults of those `buffer.*` fields: a value the
        user set (in the file or an override) wins."""
        for key, value in algo_names.PRESET_FILTERS.get(self.algorithm.preset or "", {}).items():
            if key not in self.buffer.model_fields_set:
                setattr(self.buffer, key, value)
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        names = self.algorithm.resolved_names()
        group_advantages = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "batch_norm", "maxrl"}
        if names["advantage"] in group_advantages and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"advantage {names['advantage']!r} needs a group: set rollout.samples_per_prompt >= 2 "
                f"(got {self.rollout.samples_per_prompt})"
            )
        if names["loss"] == "gvpo" and self.rollout.samples_per_prompt < 2:
            raise ValueError("loss 'gvpo' needs rollout.samples_per_prompt >= 2")
        if names["advantage"] in {"gae", "vapo"} and not self.learner.critic:
            raise ValueError(f"advantage {names['advantage']!r} needs a critic: set learner.critic = true")
        if self.mode == "sync" and self.buffer.max_staleness != 0:
            raise ValueError(
                f"mode 'sync' is on-policy: buffer.max_staleness must be 0 (got {self.buffer.max_staleness})"
            )
        if self.mode == "sao" and self.rollout.samples_per_prompt != 1:
            raise ValueError(
                f"mode 'sao' is single-rollout: rollout.samples_per_prompt must be 1 (got {self.rollout.samples_per_prompt})"
            )
        if self.learner.prompts_per_step % self.learner.mini_batches:
            raise ValueError(
                f"learner.prompts_per_step ({self.learner.prompts_per_step}) must split into learner.mini_batches "
                f"({self.learner.mini_batches}) equal mini-batches of whole groups"
            )
        if (self.env.max_total_tokens or 0) > self.rollout.max_model_len:
            raise ValueError(
                f"env.max_total_tokens ({self.env.max_total_tokens}) exceeds rollout.max_model_len ({self.rollout.max_model_len})"
            )
        if self.data.task == "parquet" and not self.data.train_path:
            raise ValueError("data.task 'parquet' needs data.train_path")
        self._collective_placement()
        return self

    def _collective_placement(self) -> None:
        """`weight_sync.transport: collective` joins learner rank 0 and each engine in a group of their own: gloo
        between CPUs, NCCL between GPUs, so both sides need the same kind of device; and NCCL refuses two ranks on
        one GPU, so the learner rank needs whole GPUs (with a share, Ray can put an engine on rank 0's GPU)."""
        if self.weight_sync.transport != "collective":
            return
        learner_gpus, engine_gpus = self.learner.num_gpus_per_rank, self.rollout.num_gpus_per_worker
        if (learner_gpus > 0) != (engine_gpus > 0):
            raise ValueError(
                "weight_sync.transport 'collective' connects the learner and the engines over gloo (CPU to CPU) or NCCL (GPU to GPU): "
                f"learner.num_gpus_per_rank ({learner_gpus:g}) and rollout.num_gpus_per_worker ({engine_gpus:g}) must both be 0 or both be > 0"
            )
        if learner_gpus % 1:
            raise ValueError(
                f"weight_sync.transport 'collective' on GPUs needs whole GPUs per learner rank: learner.num_gpus_per_rank is {learner_gpus:g}, so an "
                "engine can share rank 0's GPU, where NCCL refuses two ranks; use a whole number, or transport shared_memory or object_store"
            )

    def run_dir(self) -> Path:
        """The run's folder: `output_dir`, under `storage.uri` when one is set."""
        if self.storage.uri is None:
            return Path(self.output_dir)
        root = self.storage.uri.removeprefix("file://")
        return Path(root) / self.output_dir.lstrip("/")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(self.dump(), sort_keys=False))
        (folder / "config.json").write_text(json.dumps(self.dump(), indent=2))
        return path


# ---------------------------------------------------------------------------------------------------
# Loading: YAML + overrides, with errors that name the key, the file and the closest valid name.


def _did_you_mean(word: str, options: Any) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(data: Any, model: type[BaseModel], prefix: str, source: str) -> None:
    """Reject unknown keys before pydantic does, so the message names the closest valid key."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{dotted}'{_did_you_mean(key, fields)}; valid keys here: {', '.join(fields)}"
            )
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(value, annotation, f"{dotted}.", source)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else None
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe and apply `section.key=value` overrides. `path` is a file, or the name of a shipped
    recipe (`scalerl`, `sao.yaml`); None is the embedded default (`default`)."""
    path = resolve_recipe_path(path)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    _check_keys(data, Config, "", source)
    for text in overrides:
        keys, value = parse_override(text)
        _check_keys(_nest(keys, value), Config, "", f"override {text!r}")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{key}' is not a section")
        node[keys[-1]] = value
    return validate_config(data, f"{source} with overrides {' '.join(overrides)}" if overrides else source)


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_recipe_path(path: str | Path | None) -> Path:
    """A file that exists wins; otherwise a bare name (no directory part) names a shipped recipe."""
    if path is None:
        return DEFAULT_CONFIG
    path = Path(path)
    if path.exists() or len(path.parts) > 1:
        return path
    shipped = RECIPES / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if shipped.exists():
        return shipped
    raise ConfigError(
        f"config file not found: {path} (not a file, nor a shipped recipe: {', '.join(shipped_recipes())})"
    )


def _nest(keys: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(keys):
        value = {key: value}
    return value


def validate_config(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError(f"{source}: invalid config\n" + "\n".join(lines)) from None
