"""The record of one published LoRA adapter (`learner.lora`): what travels to the engines instead of the weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AdapterWeights"]


@dataclass(frozen=True)
class AdapterWeights:
    """The policy's adapters at one version: PEFT's two files' contents, which an engine writes into its own
    adapter folder and loads in place through vLLM's LoRA support (`asyncrl.rollout.vllm_compat.adapter`)."""

    data: bytes
    """`adapter_model.safetensors`: the adapter tensors under PEFT's names, in the engines' dtype."""
    config: dict[str, Any] = field(default_factory=dict)
    """`adapter_config.json` (`asyncrl.learner.lora.peft_config`)."""
    num_tensors: int = 0

    @property
    def num_bytes(self) -> int:
        return len(self.data)
