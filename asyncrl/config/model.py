"""Sections of what is trained on: the model (`model`) and the prompts (`data`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section

FamilyName = Literal["qwen2", "qwen2-untied", "qwen3", "llama3", "mistral", "gemma2", "qwen3-moe"]
"""The names of `asyncrl.models.families.FAMILIES` (tests/unit/envs/test_chat_calc.py checks they agree)."""


class FamilyShape(Section):
    """Sizes of a `model.family` checkpoint that differ from the tiny shape every family shares
    (`asyncrl.models.families.family_shape`: hidden 64, intermediate 128, 2 layers, 2 query heads and 1 key/value
    head of 32). Unset keys keep the shared size; the head size is `hidden_size / num_attention_heads` and must be
    one vLLM's CPU attention serves."""

    hidden_size: int | None = Field(None, ge=1)
    """Width of the residual stream (shared: 64)."""
    intermediate_size: int | None = Field(None, ge=1)
    """Width of each MLP (shared: 128)."""
    num_hidden_layers: int | None = Field(None, ge=1)
    """Decoder layers (shared: 2)."""
    num_attention_heads: int | None = Field(None, ge=1)
    """Query heads (shared: 2); must divide `hidden_size`."""
    num_key_value_heads: int | None = Field(None, ge=1)
    """Key/value heads (shared: 1); must divide `num_attention_heads`."""

    def changes(self) -> dict[str, int]:
        """The keys that are set (`asyncrl check` checks the shape they make: `asyncrl.models.families.family_shape`,
        and the head size against vLLM's CPU attention)."""
        return self.model_dump(exclude_none=True)


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face model directory. When unset, the `preset` tiny model is built locally (and cached)."""
    allow_untested_architecture: bool = False
    """Start a `path` whose architecture is not one of the families asyncrl tests (docs/models.md): `asyncrl check`
    then notes it instead of refusing it. The learner runs any Hugging Face causal LM with a decoder stack
    (`get_decoder()`); what is untested is whether vLLM's module takes the learner's weight names and matches its
    log-probs: watch the weight-sync parity (`weight_sync.parity_probe`) of the first steps."""
    preset: str = "add-1m"
    """Tiny Qwen2-architecture preset from `asyncrl.models` (used when `path` is unset)."""
    family: FamilyName | None = None
    """Build a tiny random-init checkpoint of this Hugging Face model family instead of `preset` (when `path` is
    unset): `qwen2`, `qwen3`, `llama3`, ... (`asyncrl.models.families`), with a byte-level BPE tokenizer and the
    family's chat template, so the OpenAI endpoint serves it as it would the real model. With `data.task: calc` or
    `word_problems` it is warm-started on tool-calling chat (`asyncrl.envs.warm_start.warm_start_chat_calc`: real
    tool calls in the chat format; for the built-in harness `asyncrl.envs.chat_calc:agent`)."""
    family_shape: FamilyShape = FamilyShape()
    """`model.family`'s sizes where they differ from the shared tiny shape, e.g. `{hidden_size: 128,
    num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2}` (a wider model that learns the `calc`
    chat task's copies, which the shared shape does not: benchmarks/notes/agent_framework.md). Part of the cached
    model's key."""
    warm_start_examples: int = Field(2000, ge=0, le=100_000)
    """Supervised warm-start examples for the built-in task (0 = start from random weights). W1 allows at most
    2,000. Without dropout, 20,000 seen ~2.4 times give a start RL lifts further than 2,000 seen ~15 times
    (the `add_20k` recipe; benchmarks/RESULTS.md); within 2,000, `warm_start_dropout` does it."""
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
    2,000-example start one RL can lift: at the same validation target, 0.2 gave a start the plain
    GRPO loop lifts +0.47 in 200 steps, against +0.26 without (asyncrl/envs/warm_start.py; seed 0). Dropout
    delays the supervised transition: a start that has not met `warm_start_target` within `warm_start_epochs`
    is trained again from its initial weights without dropout (as seeds 1 and 2 are). 0 = none."""
    warm_start_tool_fraction: float = Field(0.3, ge=0, le=1)
    """The agent tasks (`calc`, `word_problems`): fraction of warm-start examples that call the calculator (the rest
    answer in the head); their warm start runs `warm_start_epochs` epochs (no accuracy target unless
    `warm_start_chat_target`)."""
    warm_start_chat_target: float | None = Field(None, gt=0, le=1)
    """The agent tasks as tool-calling chat (`model.family`): stop the warm start once greedy whole-episode success on
    50 validation problems (disjoint from the held-out set) reaches this, checked every 50 steps. The copies the task
    needs form abruptly at a step that moves with the examples' order and the seed, so a target stops each seed's
    start at the same point of that transition, when it comes within `warm_start_epochs` (the `calc_agents_sdk`
    recipe; `warm_start.json` records `target_reached`). None = all `warm_start_epochs`."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the learner's decoder layers and weight dtype of the engines. With `bfloat16` the
    learner keeps fp32 master weights, optimizer state, gradient reductions and head (FSDP2 mixed
    precision, or its casts without FSDP on one rank; docs/algorithms.md#mixed-precision) and sends the
    engines bf16 roundings of its weights. fp32 gives 1e-5 log-prob parity on CPU."""

    @model_validator(mode="after")
    def _shape_of_a_family(self) -> ModelConfig:
        if self.family_shape.changes() and self.family is None:
            raise ValueError("model.family_shape is set but model.family is not (it sizes a family's checkpoint)")
        return self


class DataConfig(Section):
    task: Literal["add", "parquet", "calc", "word_problems"] = "add"
    """`add` generates the W1 task; `parquet` reads verl-layout files from `train_path` / `eval_path`; `calc`
    (multi-operand sums to solve with the calculator) and `word_problems` (templated arithmetic stories) are
    generated locally for the agent environments (docs/environments.md)."""
    train_path: str | None = None
    """Training prompts (verl column layout) when `task: parquet`: a Parquet file, a folder (its `*.parquet`
    files, recursively) or a glob, read in sorted path order (docs/data.md)."""
    eval_path: str | None = None
    """Held-out prompts when `task: parquet` (file, folder or glob): the first `eval_prompts` in file order."""
    shuffle_window: int = Field(4, ge=0)
    """`task: parquet`: each epoch visits the row groups in an order seeded by `seed` and the epoch, and shuffles
    the rows of this many row groups together (they are resident meanwhile); 0 = file order, no shuffle."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """`task: parquet`: longer prompts (in tokens, chat template applied) are skipped and counted
    (`data.prompts_dropped` in summary.json); None = rollout.max_model_len - rollout.max_tokens."""
    eval_prompts: int = Field(500, ge=1)
    """Number of held-out prompts used for evaluation."""
    max_operand: int = Field(999, ge=1)
    """Largest operand of the `add` task (operands are uniform in [0, max_operand])."""
    operands: int = Field(3, ge=2, le=8)
    """Operands of one `calc` problem (each a 3-digit number)."""
    seed: int = 0
    """Seed of the prompt stream (and of a Parquet dataset's shuffle); the held-out set uses its own fixed seed."""
