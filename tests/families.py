"""Every model family of `asyncrl.models.families`, built once per test module (one BPE tokenizer per chat format)."""

from __future__ import annotations

from pathlib import Path


def build_families(root: Path, names=None, seed: int = 0) -> dict[str, Path]:
    """family name -> its checkpoint folder under `root` (tiny, random init, `seed`)."""
    from asyncrl.models.bpe import train_bpe
    from asyncrl.models.families import FAMILIES, build_family

    tokenizers: dict[str, object] = {}
    out = {}
    for name in names or FAMILIES:
        chat_format = FAMILIES[name].chat_format
        if chat_format not in tokenizers:
            tokenizers[chat_format] = train_bpe(chat_format)
        out[name] = build_family(name, Path(root) / name, tokenizer=tokenizers[chat_format], seed=seed)
    return out


def even_length_reward(response: str, ground_truth: str, *, finish_reason: str, extra_info: dict) -> float:
    """1 for a response of an even number of characters: a random-init model earns it about half the time, so
    its groups have reward variance (`env.reward: tests.families:even_length_reward`)."""
    return float(len(response) % 2 == 0)
