"""Engine-side weight loading: the tied head a model computes from its embedding (vLLM's Gemma 2) is left out only
when it is that embedding, and a model with fused MoE experts never loads in place (their CPU kernel reads a
prepacked layout)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from asyncrl.rollout.vllm_compat.weights import _unpack_linear_layers, _without_retied_head

EMBED = torch.arange(12.0).reshape(4, 3)
LAYER = ("model.layers.0.mlp.down_proj.weight", torch.ones(3, 3))


class NoHead(nn.Module):
    """Like vLLM's Gemma2ForCausalLM: logits from `model.embed_tokens`, no `lm_head` module."""


class WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(3, 4, bias=False)


def _names(model, tied: bool, named) -> list[str]:
    return [n for n, _ in _without_retied_head(model, iter(named), SimpleNamespace(tie_word_embeddings=tied))]


def test_a_tied_model_without_a_head_module_gets_everything_but_the_tied_head():
    named = [("model.embed_tokens.weight", EMBED), LAYER, ("lm_head.weight", EMBED.clone())]
    assert _names(NoHead(), True, named) == ["model.embed_tokens.weight", LAYER[0]]


def test_a_head_that_differs_from_the_embedding_is_not_dropped_silently():
    named = [("lm_head.weight", EMBED + 1), ("model.embed_tokens.weight", EMBED), LAYER]
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        _names(NoHead(), True, named)


@pytest.mark.parametrize(("model", "tied"), [(NoHead(), False), (WithHead(), True)])
def test_an_untied_model_or_one_with_a_head_module_gets_the_head(model, tied):
    named = [("model.embed_tokens.weight", EMBED), ("lm_head.weight", EMBED + 1)]
    assert _names(model, tied, named) == ["model.embed_tokens.weight", "lm_head.weight"]


def _method(name: str):
    return type(name, (), {})()


def test_a_model_with_fused_moe_experts_reloads_instead_of_loading_in_place():
    model = nn.Module()
    model.qkv = nn.Linear(3, 3)
    model.qkv.quant_method, model.qkv.cpu_linear = _method("UnquantizedLinearMethod"), None
    model.experts = nn.Module()
    model.experts.quant_method = _method("UnquantizedFusedMoEMethod")
    assert _unpack_linear_layers(model) is False
    assert model.qkv.cpu_linear is None  # nothing was changed


def test_a_dense_model_of_plain_linear_layers_loads_in_place():
    from asyncrl.rollout.vllm_compat.weights import _plain_linear

    model = nn.Module()
    model.qkv = nn.Linear(3, 3)
    model.qkv.quant_method, model.qkv.cpu_linear = _method("UnquantizedLinearMethod"), None
    model.attn = nn.Module()  # a module without a quantization method (attention) does not count
    assert _unpack_linear_layers(model) is True
    assert model.qkv.cpu_linear is _plain_linear


def test_reloaded_cpu_moe_experts_are_prepacked_again():
    """vLLM 0.32 prepacks CPU experts only on the first load; after a reload their storage holds checkpoint-format
    weights, which `_prepack_cpu_experts` packs (the kernel's own `cpu_prepack_moe_weight`)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    from asyncrl.rollout.vllm_compat.weights import _prepack_cpu_experts

    experts_cls = type("CPUUnquantizedExperts", (), {"isa": "vec", "_use_zentorch": False})
    layer = nn.Module()
    layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts_cls()))
    w13, w2 = torch.randn(4, 128, 64), torch.randn(4, 64, 64)
    layer.w13_weight, layer.w2_weight = nn.Parameter(w13.clone()), nn.Parameter(w2.clone())
    dense = nn.Module()
    dense.quant_method = _method("UnquantizedLinearMethod")
    model = nn.Sequential(layer, dense)
    assert _prepack_cpu_experts(model) == 1
    assert torch.equal(layer.w13_weight.data, cpu_prepack_moe_weight(w13, "vec"))
    assert torch.equal(layer.w2_weight.data, cpu_prepack_moe_weight(w2, "vec"))
    assert not torch.equal(layer.w13_weight.data, w13)
