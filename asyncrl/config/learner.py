"""Sections of training: the learner ranks (`learner`) and how weights reach the engines (`weight_sync`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder block that `learner.lora` may adapt (the attention and MLP projections of the
dense families), as named in transformers' modules, PEFT adapters and vLLM's LoRA."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA) trained instead of the policy's weights, when `learner.lora` is set (e.g.
    `learner.lora.rank=16`, or `learner.lora={}` for the defaults): the base model stays frozen on the learner and
    in the engines, which serve it with the adapter through vLLM's LoRA; only the adapter travels at each sync."""

    rank: int = Field(8, ge=1, le=512)
    """Rank r of each adapter: a target layer y = W x computes y = W x + (alpha / r) B A x with A [r, in] and
    B [out, r]; B starts at zero, so the first step starts from the base model exactly."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during the passes with gradients (PEFT's `lora_dropout`). Above 0 the
    learner's training forward differs from the engines' (and from pi_old's, which runs without gradients)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Which linear layers of every decoder block get an adapter (names from `LORA_TARGETS`); each must exist in
    the model (checked when the learner builds it, naming this key)."""

    @model_validator(mode="after")
    def _known_targets(self) -> LoraConfig:
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(
                f"learner.lora.target_modules {self.target_modules}: "
                + (f"unknown {unknown}; " if unknown else "empty; ")
                + f"choose among {', '.join(LORA_TARGETS)}"
            )
        return self


class LearnerConfig(Section):
    num_ranks: int = Field(1, ge=1, le=4096)
    """Learner processes forming one torch.distributed group, sharding the policy with FSDP2 (`fsdp`).
    Independent of the rollout pool."""
    training_backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """What trains the policy on the ranks: `fsdp2` (the Hugging Face model sharded with FSDP2, `fsdp`; every
    supported family, a critic, `compile`, `activation_checkpointing`, `routing_replay`, bf16 compute) or `megatron`
    (megatron-core's `GPTModel` with tensor parallelism, `tensor_parallel`; Qwen2, Qwen3, Llama and Mistral, and
    Qwen3-MoE without tensor parallelism; the policy only, fp32 or bf16 compute (`model.dtype`) as FSDP2's, the same
    step, losses and exports; its checkpoints convert to FSDP2's and back: `asyncrl convert-checkpoint`).
    (`backend` is the torch.distributed backend.) docs/architecture.md#learner-backends."""
    tensor_parallel: int = Field(1, ge=1, le=64)
    """Ranks that split each layer of the policy (megatron's tensor parallelism, `training_backend` megatron only):
    `num_ranks` / `tensor_parallel` data-parallel replicas; it must divide `num_ranks`, the attention heads and the
    key-value heads (`asyncrl check` reads them from the model)."""
    fsdp: Literal["auto", "always", "never"] = "auto"
    """Whether the ranks wrap the policy (and the critic) with FSDP2's `fully_shard`: `auto` = with several ranks;
    one rank then runs a plain module (in bf16 its decoder layers get FSDP2's mixed-precision casts from two hooks:
    the same numerics, 5-20% faster per step on CPU, benchmarks/RESULTS.md). `always` wraps one rank too: FSDP2's
    mixed-precision policy, DTensor parameters and sharded state on a one-device mesh (what several ranks run, on
    one). `never` keeps a plain module and needs `num_ranks` = 1 (several ranks shard). Checkpoints, exports and
    weight syncs are the same either way; a checkpoint loads into any other setting and number of ranks."""
    rank_memory_gb: float | None = Field(None, gt=0)
    """Memory one rank may use for its train state, in GB (1e9 bytes); None = unchecked. Before any rank starts, the
    pool computes each rank's share from the model's parameter shapes: fp32 parameters, gradients and AdamW's two
    moments (16 bytes per parameter, policy and critic), divided over `num_ranks` as FSDP2 shards them (the megatron
    backend: over `tensor_parallel`, each data-parallel replica holding a whole piece, norms whole on every rank;
    with `lora`: 4 bytes per frozen base weight, 16 per adapter parameter, no reference copy), and at least the
    whole fp32 model each rank loads before sharding; over the budget it stops naming the figures and the smallest
    `num_ranks` (megatron: `tensor_parallel`) that fits. Activations (`tokens_per_microbatch`) and
    the framework's own memory come on top: leave room for them."""
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
    """Token budget of one micro-batch: the slots its forward computes (packed bins, or padded rows x longest row
    without `packing`)."""
    packing: bool = True
    """Pack a micro-batch's sequences into bins (`asyncrl.learner.packing`): position ids restart per sequence and the
    attention mask never crosses one, so short sequences do not pay for the longest. Loss, gradients and mismatch
    figures equal the padded rows' to float rounding. Needs transformers' `sdpa` or `eager` attention; any other,
    and the megatron backend, keep padded rows."""
    share_group_prompt: bool = True
    """With `packing`: the samples of a group whose prompt token ids (and engine routes) are identical share one
    prompt segment, computed once, each response attending to the prompt and to itself only; exact like packing."""
    compile: bool = False
    """`torch.compile` the decoder layers of the policy (and the critic) for the passes with gradients, with dynamic
    shapes (one graph for every batch size and length); passes without gradients (pi_old, the parity probe) stay
    eager. The graphs are built during set-up, before the first rollout: ~10-40 s on a 2-vCPU host for a Qwen2
    layer (two ranks compile at once), more for larger models. In fp32 the gradients match the eager ones to
    float rounding, with FSDP2 too. Needs a C++ compiler where the learner runs (inductor); benchmarks/RESULTS.md
    has W1's step with and without it."""
    activation_checkpointing: bool = False
    """Recompute every decoder layer's activations (policy and critic) in the backward instead of keeping them: a
    layer keeps only its input, so the activations a micro-batch holds shrink by about the number of layers (to 0.25
    on add-1m's 4), for one more forward of the layers in the backward (1.13x W1's step, 1.24x on 1,024-token
    rows; on an H100 a 16-layer model kept 0.12-0.19 of the peak at 1.27-1.46x: benchmarks/RESULTS.md); longer
    sequences or larger `tokens_per_microbatch` then fit a rank. Log-probs, gradients and updates equal those without
    it (bit for bit on CPU), with FSDP2, in bf16 and with `compile`."""
    routing_replay: bool = False
    """MoE routing replay (R3): the learner routes each token to the experts the engine chose for it (carried in the
    trajectory), with gate weights from its own router over those experts, so a near-tie that rounds the other way
    on the learner does not score a token with another sub-network (`asyncrl.learner.routing`; Qwen3-MoE and
    Mixtral). Needs an MoE model and engines that return routed experts: `asyncrl check` says why vLLM 0.32's do
    not here (`asyncrl.rollout.vllm_compat.routes`)."""
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
    reference_path: str | None = None
    """The frozen reference policy of the KL-to-reference loss term (`algorithm.params.kl_coef` > 0): a Hugging Face
    model folder (config.json and weights) with the policy's vocabulary; None = the run's starting weights
    (`model.path` or the built preset). Loaded on each rank only when the recipe needs it, sharded like the policy,
    in eval mode without gradients or optimizer state; never checkpointed or exported (a resumed run reloads it
    from here). On several nodes the folder must exist on each learner node. Its fp32 weights (4 bytes per
    parameter, divided over `num_ranks`) count in `rank_memory_gb`."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl on GPU, gloo on CPU."""
    num_cpus_per_rank: float = Field(1.0, gt=0)
    """Ray CPUs reserved by each learner rank."""
    cpu_nice: int = Field(0, ge=0, le=19)
    """The niceness each learner rank's process runs at (POSIX `nice`, 0-19; higher yields the CPU more): on a
    CPU machine whose engines and learner share cores, a nice learner leaves the engines the cores they need
    while both have work, and still gets every cycle they leave idle (benchmarks/notes/learning_add_w1speed.md)."""
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
    setup_timeout_s: float = Field(300.0, gt=0)
    """The ranks' start (load the model, join the process group, shard) must end within this, plus a minute for
    the calls around it; otherwise the run stops naming the rank. A 0.5B fp32 model took 92-230 s on the 2-core
    test machine (benchmarks/RESULTS.md, model_scale): raise it for larger models or slow storage."""
    seed: int = 0
    """Seed of model init noise and micro-batch order."""
    lora: LoraConfig | None = None
    """Train low-rank adapters (LoRA) instead of every weight: the base model stays frozen, only the adapters are
    in the optimizer, checkpoints and weight syncs (the engines serve the base model with the adapter through vLLM's
    LoRA support, loaded in place at each sync); `export_hf` writes the merged model and a PEFT adapter folder.
    None (the default) trains every weight. The fsdp2 backend only. docs/weight_sync.md#lora."""

    @model_validator(mode="after")
    def _several_ranks_shard(self) -> LearnerConfig:
        if self.fsdp == "never" and self.num_ranks > 1:
            raise ValueError(
                f"learner.fsdp = 'never' runs a plain module on one rank, but learner.num_ranks = {self.num_ranks}: "
                "several ranks shard the model with FSDP2 (set learner.fsdp to auto or always, or num_ranks to 1)"
            )
        return self

    @model_validator(mode="after")
    def _megatron_settings(self) -> LearnerConfig:
        if self.training_backend != "megatron":
            if self.tensor_parallel != 1:
                raise ValueError(
                    f"learner.tensor_parallel = {self.tensor_parallel} needs learner.training_backend = megatron"
                )
            return self
        if self.num_ranks % self.tensor_parallel:
            raise ValueError(
                f"learner.tensor_parallel ({self.tensor_parallel}) must divide learner.num_ranks ({self.num_ranks})"
            )
        unsupported = [
            k for k in ("critic", "compile", "activation_checkpointing", "routing_replay", "lora") if getattr(self, k)
        ]
        if unsupported:
            raise ValueError(
                f"learner.training_backend = megatron does not support learner.{', learner.'.join(unsupported)}: "
                f"unset {'it' if len(unsupported) == 1 else 'them'} (false; learner.lora: null) "
                "or use training_backend = fsdp2"
            )
        return self

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
    delta: bool = False
    """Send only what changed since the version the engines serve (full fine-tuning): rank 0 keeps the last
    version sent and each engine one copy of the weights it serves; changed tensors travel dense or as indices +
    values, bit-exact; a join, a replacement or a digest mismatch gets the full version (docs/weight_sync.md).
    Through the object store only: `transport` must be `object_store` or `auto` (which then picks it)."""

    @model_validator(mode="after")
    def _delta_through_the_object_store(self) -> WeightSyncConfig:
        if self.delta and self.transport not in ("object_store", "auto"):
            raise ValueError(
                f"weight_sync.delta sends deltas through the object store: weight_sync.transport = "
                f"{self.transport!r} cannot carry them (set transport to object_store or auto, or delta to false)"
            )
        return self
