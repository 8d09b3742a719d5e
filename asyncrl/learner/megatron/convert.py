"""Per-family converters between a Hugging Face checkpoint's tensors and megatron-core's `GPTModel` (local layer
spec), both directions, on whole (unsharded) tensors; `shard` and `unshard` cut them into tensor-parallel pieces and
join them again.

The converter contract (docs/architecture.md, "Learner backends"): a family's converter says which megatron
`TransformerConfig` fields its Hugging Face config implies (`config_fields`) and maps a full Hugging Face state dict
to megatron names and layouts (`to_megatron`) and back (`to_hf`) such that `to_hf(to_megatron(s)) == s` tensor for
tensor and the megatron model's logits equal transformers' (tests/unit/learner/test_megatron.py). One converter
serves the dense decoder families (Qwen2 with QKV biases, Qwen3 with q/k norms, Llama 3, Mistral), tied or not;
`MoeConverter` Qwen3-MoE.

Megatron's layouts: the attention's Q, K and V projections are ONE `linear_qkv` whose rows are grouped by query group,
`[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]` (the bias likewise); the MLP's gate and up
projections are one `linear_fc1`, `[gate; up]`; under tensor parallelism every rank holds `[gate_r; up_r]`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["CONVERTERS", "DenseConverter", "MoeConverter", "converter_for", "shard", "unshard"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Hugging Face per-layer suffix -> megatron per-layer suffix, for tensors that keep their layout.
_SAME_LAYOUT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_GATED_FC1 = "mlp.linear_fc1.weight"


@dataclass(frozen=True)
class DenseConverter:
    """A dense decoder family: RMSNorm, RoPE, grouped-query attention (optional QKV biases, optional q/k RMSNorm),
    SwiGLU MLP, tied or untied head."""

    model_type: str

    def config_fields(self, hf_config) -> dict:
        """The `TransformerConfig` fields of `hf_config`'s architecture (shapes, norms, biases)."""
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
            kv_channels=head_dim,
            layernorm_epsilon=hf_config.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            add_bias_linear=False,
            add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)) or self.model_type == "qwen2",
            qk_layernorm=self.model_type.startswith("qwen3"),
        )

    def to_megatron(self, hf: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
        """Hugging Face names and layouts -> megatron's (a tied model's `lm_head.weight` is dropped)."""
        out: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        gated: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in hf.items():
            if name in _TOP:
                if name == "lm_head.weight" and _tied(hf_config):
                    continue
                out[_TOP[name]] = tensor
                continue
            layer, rest = _split_layer(name)
            if rest in _SAME_LAYOUT:
                out[f"decoder.layers.{layer}.{_SAME_LAYOUT[rest]}"] = tensor
            elif (m := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)) is not None:
                qkv.setdefault((layer, m.group(2)), {})[m.group(1)] = tensor
            elif (m := re.fullmatch(r"mlp\.(gate|up)_proj\.weight", rest)) is not None:
                gated.setdefault(layer, {})[m.group(1)] = tensor
            else:
                raise KeyError(f"{self.model_type}: no megatron name for Hugging Face tensor {name!r}")
        for (layer, kind), parts in qkv.items():
            out[f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"] = _fuse_qkv(parts, hf_config)
        for layer, parts in gated.items():
            out[f"decoder.layers.{layer}.{_GATED_FC1}"] = torch.cat([parts["gate"], parts["up"]])
        return out

    def to_hf(self, mc: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
        """Megatron names and layouts -> Hugging Face's; a tied model gets no `lm_head.weight` (the export adds it)."""
        top = {v: k for k, v in _TOP.items()}
        same = {v: k for k, v in _SAME_LAYOUT.items()}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in mc.items():
            if name in top:
                out[top[name]] = tensor
                continue
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
            if m is None:
                raise KeyError(f"{self.model_type}: no Hugging Face name for megatron tensor {name!r}")
            layer, rest = int(m.group(1)), m.group(2)
            prefix = f"model.layers.{layer}."
            if rest in same:
                out[prefix + same[rest]] = tensor
            elif (k := re.fullmatch(r"self_attention\.linear_qkv\.(weight|bias)", rest)) is not None:
                for proj, part in zip("qkv", _split_qkv(tensor, hf_config), strict=True):
                    out[f"{prefix}self_attn.{proj}_proj.{k.group(1)}"] = part
            elif rest == _GATED_FC1:
                gate, up = tensor.chunk(2)
                out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
            else:
                raise KeyError(f"{self.model_type}: no Hugging Face name for megatron tensor {name!r}")
        return out


_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MC_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")
_MC_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc(1|2)\.weight$")


@dataclass(frozen=True)
class MoeConverter(DenseConverter):
    """Qwen3-MoE: the dense attention of Qwen3 and, in every layer, a softmax router over `num_experts` SwiGLU
    experts of which the top `num_experts_per_tok` mix with renormalized weights (`norm_topk_prob`). transformers keeps
    the experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]); megatron has one
    `local_experts.<e>` MLP per expert (`linear_fc1` = `gate_up_proj[e]`) and `mlp.router`. Converted in transformers'
    in-memory layout; exports revert it to the checkpoint's (`asyncrl.learner.export.checkpoint_layout`)."""

    def config_fields(self, hf_config) -> dict:
        if not getattr(hf_config, "norm_topk_prob", True) or getattr(hf_config, "mlp_only_layers", None):
            raise ValueError(f"{self.model_type}: megatron needs norm_topk_prob and an MoE block in every layer")
        return dict(
            super().config_fields(hf_config),
            qk_layernorm=True,
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_pre_softmax=False,  # softmax over the top-k logits = the renormalized top-k probabilities
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )

    def to_megatron(self, hf: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
        moe = {k: v for k, v in hf.items() if _ROUTER.match(k) or _EXPERTS.match(k)}
        out = super().to_megatron({k: v for k, v in hf.items() if k not in moe}, hf_config)
        for name, tensor in moe.items():
            if (m := _ROUTER.match(name)) is not None:
                out[f"decoder.layers.{m.group(1)}.mlp.router.weight"] = tensor
            elif (m := _EXPERTS.match(name)) is not None:
                fc = "linear_fc1" if m.group(2) == "gate_up_proj" else "linear_fc2"
                for e, piece in enumerate(tensor):
                    out[f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{e}.{fc}.weight"] = piece
        return out

    def to_hf(self, mc: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
        moe = {k: v for k, v in mc.items() if _MC_ROUTER.match(k) or _MC_EXPERT.match(k)}
        out = super().to_hf({k: v for k, v in mc.items() if k not in moe}, hf_config)
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, tensor in moe.items():
            if (m := _MC_ROUTER.match(name)) is not None:
                out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = tensor
            elif (m := _MC_EXPERT.match(name)) is not None:
                proj = "gate_up_proj" if m.group(3) == "1" else "down_proj"
                experts.setdefault((m.group(1), proj), {})[int(m.group(2))] = tensor
        for (layer, proj), pieces in experts.items():
            out[f"model.layers.{layer}.mlp.experts.{proj}"] = torch.stack([pieces[e] for e in sorted(pieces)])
        return out


CONVERTERS: dict[str, DenseConverter] = {
    **{t: DenseConverter(t) for t in ("qwen2", "qwen3", "llama", "mistral")},
    "qwen3_moe": MoeConverter("qwen3_moe"),
}
"""Converters by `config.json`'s `model_type`."""


def converter_for(hf_config) -> DenseConverter:
    """The converter of `hf_config`'s family; a ValueError naming the supported ones otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CONVERTERS:
        raise ValueError(
            f"learner.training_backend = megatron has no converter for model_type {model_type!r} "
            f"(supported: {', '.join(CONVERTERS)}); use learner.training_backend = fsdp2"
        )
    return CONVERTERS[model_type]


def _tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _split_layer(name: str) -> tuple[int, str]:
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no megatron name for Hugging Face tensor {name!r}")
    return int(m.group(1)), m.group(2)


def _heads(hf_config) -> tuple[int, int]:
    """(query heads per query group, query groups)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    return heads // groups, groups


def _fuse_qkv(parts: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    per_group, groups = _heads(hf_config)
    q, k, v = (parts[p] for p in "qkv")
    rest = q.shape[1:]
    q, k, v = q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group, groups = _heads(hf_config)
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, -1, *rest)
    head_dim = grouped.shape[1] // (per_group + 2)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def shard(name: str, full: torch.Tensor, partition_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s piece of the whole megatron tensor `full` (`partition_dim` None: replicated);
    a gated `linear_fc1` gives every rank its slice of the gate and of the up projection."""
    if partition_dim is None or size == 1:
        return full.clone()
    if name.endswith(_GATED_FC1):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).clone()
    return full.chunk(size, dim=partition_dim)[rank].clone()


def unshard(name: str, pieces: list[torch.Tensor], partition_dim: int | None) -> torch.Tensor:
    """The whole megatron tensor from every tensor-parallel rank's piece, in rank order (`shard`'s inverse)."""
    if partition_dim is None or len(pieces) == 1:
        return pieces[0]
    if name.endswith(_GATED_FC1):
        halves = [p.chunk(2) for p in pieces]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    return torch.cat(pieces, dim=partition_dim)
