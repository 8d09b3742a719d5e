"""Serving the policy's LoRA adapter (`learner.lora`) through vLLM's LoRA support (checked with vLLM 0.32.0, CPU).

The engine is started with `enable_lora` and one adapter slot (`lora_engine_args`); every request names the same
adapter (`LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)`), so there is one adapter in the engine at a time. A sync
writes the new adapter's files into the engine's own folder and calls `add_lora` with `load_inplace=True`: vLLM's
worker loads the folder, drops the old adapter of that id and adds the new one, which its next step activates
for every running request too (they name the same id), like an in-place weight load, so the weight-version spans
of a request in flight stay right. The requests' own `LoRARequest` has `load_inplace=False` (vLLM 0.32's worker
would reload the folder at every step otherwise). vLLM's `max_lora_rank` takes a few values only
(`MAX_LORA_RANKS`): the engine is started with the smallest that holds the adapter's rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "MAX_LORA_RANKS", "load_adapter", "lora_engine_args", "lora_request"]

ADAPTER_NAME = "policy"
ADAPTER_ID = 1
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's `LoRAConfig.max_lora_rank` choices."""


def lora_engine_args(rank: int) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields of an engine that serves one adapter of rank `rank`."""
    fitting = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"learner.lora.rank = {rank}: vLLM serves adapters up to rank {MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1, "max_cpu_loras": 1}


def lora_request(folder: str, load_inplace: bool = False) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(folder), load_inplace=load_inplace)


async def load_adapter(llm: Any, record: Any, folder: str) -> tuple[int, Any]:
    """Write `record` (a `weights.adapter.AdapterWeights`) into `folder` and load it in place into `llm` (an
    `AsyncLLM`); -> (adapter tensors loaded, the `LoRARequest` requests name from now on)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(record.data)
    (path / "adapter_config.json").write_text(json.dumps(record.config))
    if not await llm.add_lora(lora_request(folder, load_inplace=True)):
        raise RuntimeError(f"vLLM did not load the adapter in {folder}")
    return record.num_tensors, lora_request(folder)
