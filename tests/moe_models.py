"""Tiny random-init MoE models for the routing-replay and MoE parity tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch


def qwen3_moe_config(vocab_size: int = 100, hidden_size: int = 64, head_dim: int = 32):
    """2 layers, 8 experts, top-2, `norm_topk_prob`; head_dim one of vLLM's CPU attention sizes."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=head_dim, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def save_qwen3_moe(out_dir: Path, seed: int = 0) -> Path:
    """A random-init `qwen3_moe_config()` model beside the ASCII character tokenizer, saved with `save_pretrained`."""
    from transformers import Qwen3MoeForCausalLM

    from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(qwen3_moe_config(vocab_size=len(tokenizer))).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
