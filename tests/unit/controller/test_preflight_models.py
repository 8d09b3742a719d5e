"""`asyncrl check` names a model folder whose architecture asyncrl does not support, or whose tokenizer has no chat
template, before anything starts; every family of `asyncrl.models.families` passes."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.controller.preflight import preflight
from asyncrl.models.families import FAMILIES, SUPPORTED_ARCHITECTURES


def _folder(tmp_path, config: dict, chat_template: str | None = "{{ messages }}"):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    tokenizer_config = {"chat_template": chat_template} if chat_template is not None else {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tmp_path


def _model_problems(folder) -> list[str]:
    cfg = load_config(None, [f"model.path={folder}"])
    return [str(p) for p in preflight(cfg, placement=False) if p.key == "model.path"]


def test_an_unsupported_architecture_is_named_with_the_supported_ones(capsys, tmp_path):
    folder = _folder(tmp_path, {"architectures": ["GPT2LMHeadModel"], "head_dim": 64})
    assert main(["check", f"model.path={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"model.path: {folder / 'config.json'}: architecture GPT2LMHeadModel is not one asyncrl supports" in err
    assert "Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM" in err and "docs/models.md" in err
    assert "model.allow_untested_architecture=true starts it anyway" in err


def test_an_untested_architecture_starts_when_allowed(tmp_path):
    folder = _folder(tmp_path, {"architectures": ["Phi3ForCausalLM"], "head_dim": 64})
    cfg = load_config(None, [f"model.path={folder}", "model.allow_untested_architecture=true"])
    assert [p for p in preflight(cfg, placement=False) if p.key == "model.path"] == []


def test_a_rank_memory_budget_a_model_path_exceeds_is_named_with_the_ranks_that_fit(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.models.families import build_family

    folder = build_family("llama3", tmp_path / "llama3")
    n = sum(v.numel() for v in load_file(folder / "model.safetensors").values())
    need_gb = 16 * n / 1e9  # fp32 weights, gradients and AdamW's two moments on one rank
    tight = [f"model.path={folder}", f"learner.rank_memory_gb={need_gb * 0.9:.6f}"]
    (problem,) = [p for p in preflight(load_config(None, tight), placement=False) if p.key == "learner.rank_memory_gb"]
    assert f"each rank needs {need_gb:.3g} GB" in problem.reason and "fits from learner.num_ranks = 2" in problem.reason
    roomy = [f"model.path={folder}", f"learner.rank_memory_gb={need_gb * 1.1:.6f}"]
    assert [p for p in preflight(load_config(None, roomy), placement=False) if p.key == "learner.rank_memory_gb"] == []


def test_a_config_without_architectures_is_named(tmp_path):
    folder = _folder(tmp_path, {"head_dim": 64})
    assert _model_problems(folder) == [f"model.path: {folder / 'config.json'} names no architecture (`architectures`)"]


@pytest.mark.parametrize("chat_template", [None, ""])
def test_a_tokenizer_without_a_chat_template_is_named(tmp_path, chat_template):
    folder = _folder(tmp_path, {"architectures": ["LlamaForCausalLM"], "head_dim": 64}, chat_template=chat_template)
    (problem,) = _model_problems(folder)
    assert problem.startswith(f"model.path: {folder} has a tokenizer without a chat template") and "docs/tokenizers.md" in problem


def test_a_chat_template_file_beside_the_tokenizer_counts(tmp_path):
    folder = _folder(tmp_path, {"architectures": ["MistralForCausalLM"], "head_dim": 64}, chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert _model_problems(folder) == []


def test_every_family_checkpoint_passes(tmp_path):
    from asyncrl.models.bpe import train_bpe
    from asyncrl.models.families import build_family

    assert set(SUPPORTED_ARCHITECTURES) == {f.architecture for f in FAMILIES.values()}
    tokenizers = {}
    for name, family in FAMILIES.items():
        tokenizer = tokenizers.setdefault(family.chat_format, train_bpe(family.chat_format))
        folder = build_family(name, tmp_path / name, tokenizer)
        assert _model_problems(folder) == [], name
