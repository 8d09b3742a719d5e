"""Tiny Qwen2-architecture models, built locally with `save_pretrained` so transformers and vLLM load them.

Presets span ~0.3M to ~0.5B parameters, built under $ASYNCRL_CACHE (default ~/.cache/asyncrl); nothing is
downloaded. Which model a run starts from (the user's `model.path`, or a preset warm-started on the built-in
task) is decided by `asyncrl.envs.model_dir.ensure_model`.
"""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.models.tokenizer import ADD_ALPHABET, ASCII_ALPHABET, CALC_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer
from asyncrl.remote import cache_root

if TYPE_CHECKING:
    from transformers import Qwen2Config


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    alphabet: str = ADD_ALPHABET
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1024


# head_dim = hidden / heads is a size vLLM's CPU attention serves (rollout/vllm_compat/limits.py).
PRESETS: dict[str, Preset] = {
    "tiny-0.3m": Preset(64, 4, 2, 1, 256),
    "add-1m": Preset(128, 4, 4, 2, 512),
    "add-3m": Preset(256, 4, 8, 4, 768),
    "ascii-1m": Preset(128, 4, 4, 2, 512, alphabet=ASCII_ALPHABET),
    "calc-1m": Preset(128, 4, 4, 2, 512, alphabet=CALC_ALPHABET),
    "w3-0.5m": Preset(96, 4, 3, 1, 320),
    "w3-25m": Preset(512, 6, 8, 4, 2048),
    "w3-125m": Preset(768, 16, 12, 4, 3072),
    "qwen-0.5b": Preset(896, 24, 14, 2, 4864, alphabet=ASCII_ALPHABET, max_position_embeddings=4096),
}


def qwen2_config(preset: Preset) -> Qwen2Config:
    from transformers import Qwen2Config

    vocab = len(SPECIAL_TOKENS) + len(preset.alphabet)
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )


def build_model(preset_name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Create a randomly initialised preset model + tokenizer in `out_dir` (save_pretrained)."""
    import torch
    from transformers import Qwen2ForCausalLM

    if preset_name not in PRESETS:
        raise ValueError(f"unknown model preset {preset_name!r}; valid: {', '.join(PRESETS)}")
    preset = PRESETS[preset_name]
    torch.manual_seed(seed)
    # transformers wraps `PreTrainedModel.to` with functools.wraps(Module.to), which types it as unbound.
    model = Qwen2ForCausalLM(qwen2_config(preset)).to(torch.float32)  # type: ignore[arg-type]
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_char_tokenizer(preset.alphabet).save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


def num_parameters(preset_name: str) -> int:
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(PRESETS[preset_name]))
    return sum(p.numel() for p in model.parameters())


@contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["PRESETS", "Preset", "build_model", "num_parameters", "cache_root", "file_lock"]
