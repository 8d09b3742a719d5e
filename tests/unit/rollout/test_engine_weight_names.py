"""Engine-side weight loading: the tied head a model computes from its embedding (vLLM's Gemma 2) is left out only
when it is that embedding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from asyncrl.rollout.vllm_compat.weights import _without_retied_head

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
