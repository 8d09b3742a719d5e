"""`learner.lora`: low-rank adapters on the policy's linear layers, trained instead of the base weights.

Each target `nn.Linear` of every decoder block (`LoraConfig.target_modules`) gets two child modules, `lora_A`
([r, in], uniform in +-1/sqrt(in) as PEFT draws it, the same on every rank) and `lora_B` ([out, r], zero), and a
forward hook that adds `(alpha / r) * lora_B(lora_A(dropout(x)))` to the layer's output. The base weights keep
their names and are frozen; the adapters are ordinary parameters of the decoder layers, so FSDP2 shards them with
their layer, `policy.cast_layers` casts them with it, and the step (packing, reduction, clipping) is unchanged:
only its optimizer holds the adapters alone. With B = 0 the first forward is the base model's exactly.

Names: the adapters' parameters are `<layer>.lora_A.weight` / `<layer>.lora_B.weight` under the Hugging Face
layer name, which with `PEFT_PREFIX` is PEFT's saved adapter layout (`adapter_model.safetensors`), the one vLLM's
LoRA loader and `peft.PeftModel.from_pretrained` read. `merged` folds them into the base weights (W + scale B A)
for everything that wants a plain model (full weight syncs, `export_hf`). `BaseModelView` runs the policy with
the adapters off: the base model, the reference policy of the KL term unless `learner.reference_path` names one.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ADAPTER_CONFIG",
    "BaseModelView",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "add_adapters",
    "adapter_state",
    "is_adapter",
    "merged",
    "peft_config",
    "write_adapter",
]

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face parameter name in a saved adapter."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"
_SWITCH = "_asyncrl_lora_switch"
"""Where the decoder layers keep the switch their adapters' hooks read (`BaseModelView` turns it off)."""


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` is an adapter's (`lora_A` / `lora_B`)."""
    return name.endswith(_A) or name.endswith(_B)


def add_adapters(decoder_layers: nn.ModuleList, cfg, seed: int = 0) -> int:
    """Attach an adapter to every `cfg.target_modules` linear layer of every block (cfg: a `LoraConfig`) and
    freeze every other parameter of the layers' model (the caller freezes what lies outside the layers); -> the
    number of adapters. A ValueError names `learner.lora.target_modules` when a target is in no block."""
    generator = torch.Generator().manual_seed(seed)
    switch = decoder_layers.__dict__.setdefault(_SWITCH, {"on": True})
    found: set[str] = set()
    count = 0
    for layer in decoder_layers:
        layer.requires_grad_(False)
        for name, module in list(layer.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in cfg.target_modules and isinstance(module, nn.Linear):
                _attach(module, cfg, generator, switch)
                found.add(leaf)
                count += 1
    missing = [m for m in cfg.target_modules if m not in found]
    if missing:
        raise ValueError(
            f"learner.lora.target_modules: {missing} are not linear layers of this model's decoder blocks "
            f"(found {sorted(found) or 'none'})"
        )
    return count


def _attach(linear: nn.Linear, cfg, generator: torch.Generator, switch: dict[str, bool]) -> None:
    weight = linear.weight
    lora_a = nn.Linear(linear.in_features, cfg.rank, bias=False, device=weight.device, dtype=weight.dtype)
    lora_b = nn.Linear(cfg.rank, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype)
    bound = 1.0 / math.sqrt(linear.in_features)  # PEFT: kaiming_uniform_(a=sqrt(5))
    with torch.no_grad():
        lora_a.weight.copy_(torch.rand(lora_a.weight.shape, generator=generator) * 2 * bound - bound)
        lora_b.weight.zero_()
    linear.lora_A, linear.lora_B = lora_a, lora_b
    delta = functools.partial(_add_delta, scale=cfg.alpha / cfg.rank, dropout=cfg.dropout, switch=switch)
    linear.register_forward_hook(delta)


def _add_delta(
    linear: nn.Module, args: tuple, output: torch.Tensor, *, scale: float, dropout: float, switch: dict[str, bool]
) -> torch.Tensor:
    if not switch["on"]:
        return output
    x = args[0]
    if dropout > 0 and torch.is_grad_enabled() and linear.training:
        x = F.dropout(x, dropout)
    lora_a, lora_b = cast(nn.Linear, linear.lora_A), cast(nn.Linear, linear.lora_B)
    return output + lora_b(lora_a(x)) * scale


class BaseModelView(nn.Module):
    """The policy with its adapters switched off while it runs: the base model, frozen by construction, which is
    a LoRA run's reference policy when `learner.reference_path` is unset (no second copy of the model). It owns no
    parameters (the policy is not registered as its child), so nothing optimizes, checkpoints or exports it."""

    def __init__(self, policy: nn.Module, decoder_layers: nn.ModuleList):
        super().__init__()
        self.__dict__["policy"], self.__dict__["switch"] = policy, decoder_layers.__dict__[_SWITCH]

    def forward(self, *args, **kwargs):
        self.switch["on"] = False
        try:
            with torch.no_grad():
                return self.policy(*args, **kwargs)
        finally:
            self.switch["on"] = True


def merged(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`state` (full tensors, adapters included) with each adapter folded into its layer's weight,
    W + scale * B A (new tensors: the inputs are left as they are), and the adapters left out."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key, a in state.items():
        if key.endswith(_A):
            base = key[: -len(_A)] + ".weight"
            b = state[key[: -len(_A)] + _B]
            out[base] = (out[base].float() + scale * (b.float() @ a.float())).to(out[base].dtype)
    return out


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of `state` (Hugging Face names) under PEFT's saved names."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter(k)}


def peft_config(cfg, base_model: str) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for adapters of `cfg` (a `LoraConfig`) on the model at `base_model`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_adapter(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) at `folder`."""
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path
