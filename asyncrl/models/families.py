"""Tiny random-init checkpoints of real Hugging Face model families, built locally with `save_pretrained` beside
a byte-level BPE tokenizer, so a run can start from `model.path` as a user's Qwen, Llama, Mistral or Gemma
checkpoint would, without downloading anything.

Each family keeps its architecture's own features (Qwen3's q/k norms, Gemma 2's soft-capping, scaled embeddings
and sliding window, Llama 3's rope scaling, an untied head, a mixture-of-experts layer) at a size whose engine
starts and steps in seconds: hidden 64, 2 layers, 2 query heads of 32 (a head size vLLM's CPU attention serves,
`asyncrl.rollout.vllm_compat.limits`); a run may ask for another shape (`model.family_shape`: `family_shape`).
Which families the learner and engines support, and how they are tested: docs/models.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "FAMILIES",
    "SHAPE_KEYS",
    "SUPPORTED_ARCHITECTURES",
    "Family",
    "build_family",
    "family_config",
    "family_shape",
    "separate_routers",
]

_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The keys of the tiny shape a run may change (`model.family_shape`); the head size follows from them."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family at test size."""

    model_type: str
    """`config.json`'s `model_type` (what `AutoConfig.for_model` builds)."""
    architecture: str
    """`config.json`'s `architectures[0]`: the class transformers and vLLM instantiate."""
    chat_format: str
    """The chat format of the family's tokenizer (`asyncrl.models.bpe.CHAT_FORMATS`)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Config fields on top of the shared tiny shape."""
    moe: bool = False
    """A mixture-of-experts family: its routers are initialised well separated (`separate_routers`)."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "chatml", {"tie_word_embeddings": True}),
    "qwen2-untied": Family("qwen2", "Qwen2ForCausalLM", "chatml", {"tie_word_embeddings": False}),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "chatml", {"tie_word_embeddings": True}),
    "llama3": Family(
        "llama",
        "LlamaForCausalLM",
        "llama3",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "mistral": Family(
        "mistral", "MistralForCausalLM", "chatml", {"tie_word_embeddings": False, "sliding_window": None}
    ),
    # Gemma 2's soft-capping of attention scores (50) and of the final logits (30), embeddings scaled by
    # sqrt(hidden), and a sliding window of 8 tokens on every other layer (short enough for the parity probes to
    # cross it). Weights drawn 5x wider than the 0.02 default so that the caps matter: dropping the attention
    # cap moves log-probs by ~5e-4, dropping the final one by ~2e-2 (50 and 2000 times the parity tolerance).
    "gemma2": Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "gemma",
        {"tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 8, "initializer_range": 0.1},
    ),
    "qwen3-moe": Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "chatml",
        {
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
        moe=True,
    ),
}


SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(f.architecture for f in FAMILIES.values()))
"""The Hugging Face architectures a run supports: those of the families above, each tested on a real learner rank
and vLLM engine, the learner's trained weights loaded by the engine with its log-probs, and one family of each kind
of head and MLP through every path of a run (tests/integration/test_model_families.py, docs/models.md);
`asyncrl check` refuses another."""


def family_shape(changes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The tiny shape with `changes` (keys of SHAPE_KEYS) on top; the head size is `hidden_size /
    num_attention_heads`. ValueError, naming the key, for another key, a size below 1, heads that do not divide
    the hidden size, or query heads that are not a multiple of the key/value heads. (Whether vLLM's CPU attention
    serves the head size is `asyncrl check`'s question: `asyncrl.rollout.vllm_compat.limits`.)"""
    changes = dict(changes or {})
    for key, value in changes.items():
        if key not in SHAPE_KEYS:
            raise ValueError(f"unknown shape key {key!r}; valid: {', '.join(SHAPE_KEYS)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} = {value!r} is not a positive integer")
    shape = {**_SHAPE, **changes}
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    if hidden % heads:
        raise ValueError(f"num_attention_heads = {heads} does not divide hidden_size = {hidden}")
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}")
    return {**shape, "head_dim": hidden // heads}


def family_config(
    name: str, tokenizer: PreTrainedTokenizerBase, shape: Mapping[str, int] | None = None
) -> PretrainedConfig:
    """The tiny config of family `name` for `tokenizer`'s vocabulary and special tokens, in float32, with the shape
    changes `shape` (`family_shape`)."""
    from transformers import AutoConfig

    family = _family(name)
    return AutoConfig.for_model(
        family.model_type,
        **family_shape(shape),
        **family.config,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=[family.architecture],
        dtype="float32",
    )


def build_family(
    name: str,
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    shape: Mapping[str, int] | None = None,
) -> Path:
    """Save a random-init (seeded) checkpoint of family `name` (shape changes `shape`: `family_shape`) and its
    tokenizer in `out_dir`; -> `out_dir`. `tokenizer` None: a byte-level BPE tokenizer trained for the family's
    chat format."""
    import torch
    from transformers import AutoModelForCausalLM

    family = _family(name)
    if tokenizer is None:
        tokenizer = _default_tokenizer(family.chat_format)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, tokenizer, shape), dtype=torch.float32)
    if family.moe:
        separate_routers(model, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def separate_routers(model: PreTrainedModel, seed: int = 0, gap: float = 4.0) -> None:
    """Spread every MoE router's (`*.mlp.gate`) logits: each expert's router row becomes `gap` times a random unit
    direction of its own. With the default 0.02-std init the experts' logits lie ~0.16 apart and 0.7% of tokens
    have their 2nd and 3rd experts within 1e-3, where fp32 rounding differences between two implementations
    (vLLM's fused MoE, transformers' loop) can swap an expert and move a token's log-prob by ~1e-2. At `gap` 4
    the median margin is 1.9 (0.08 before) and no token of 4,096 had one under 1e-4, so a parity test over a few
    hundred tokens measures the implementations, not route flips; the mixture weights stay soft (logit std 3.6).
    Decision boundaries remain: over long runs an occasional token still sits on one."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".mlp.gate") and hasattr(module, "weight"):
                rows = torch.randn(module.weight.shape, generator=generator)
                module.weight.copy_(gap * rows / rows.norm(dim=1, keepdim=True))


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _default_tokenizer(chat_format: str) -> PreTrainedTokenizerBase:
    from asyncrl.models.bpe import train_bpe

    return train_bpe(chat_format)
