import torch

from asyncrl.models import PRESETS, build_model, num_parameters


def test_presets_span_from_under_half_a_million_to_half_a_billion_parameters():
    counts = {name: num_parameters(name) for name in PRESETS}
    assert counts["tiny-0.3m"] < 400_000
    assert 0.9e6 < counts["add-1m"] < 1.1e6  # W1: hidden 128, 4 layers, vocab 16
    assert 20e6 < counts["w3-25m"] < 30e6
    assert 100e6 < counts["w3-125m"] < 150e6
    assert 0.3e9 < counts["qwen-0.5b"] < 0.6e9


def test_head_dim_is_supported_by_vllm_cpu_attention():
    for preset in PRESETS.values():
        assert preset.hidden_size % preset.num_heads == 0
        assert preset.hidden_size // preset.num_heads in (32, 64, 80, 96, 112, 128)


def test_built_model_reloads_in_transformers_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_model("tiny-0.3m", tmp_path, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 14, 7, 15]])
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
