import json

import pytest
import torch

from asyncrl.models.families import FAMILIES, build_family, family_config
from asyncrl.rollout.vllm_compat.limits import CPU_ATTENTION_HEAD_SIZES, head_size
from tests.families import build_families


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return build_families(tmp_path_factory.mktemp("families"))


def test_every_family_is_saved_as_its_hugging_face_architecture_with_a_served_head_size(family_dirs):
    for name, folder in family_dirs.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == [FAMILIES[name].architecture], name
        assert config["model_type"] == FAMILIES[name].model_type, name
        assert head_size(config).size in CPU_ATTENTION_HEAD_SIZES, name
        assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64, name


def test_the_families_keep_their_architectures_features(family_dirs):
    configs = {name: json.loads((folder / "config.json").read_text()) for name, folder in family_dirs.items()}
    assert configs["qwen2"]["tie_word_embeddings"] and not configs["qwen2-untied"]["tie_word_embeddings"]
    assert configs["gemma2"]["final_logit_softcapping"] == 30.0 and configs["gemma2"]["attn_logit_softcapping"] == 50.0
    assert configs["llama3"]["rope_parameters"]["rope_type"] == "llama3"
    assert configs["qwen3-moe"]["num_experts_per_tok"] == 2 and configs["qwen3-moe"]["num_local_experts"] == 4
    from safetensors import safe_open

    with safe_open(str(family_dirs["qwen3"] / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_norm.weight" in f.keys()
    with safe_open(str(family_dirs["qwen2-untied"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()


def test_each_family_reloads_in_transformers_with_its_tokenizer_and_chat_template(family_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name, folder in family_dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert type(model).__name__ == FAMILIES[name].architecture
        assert model.config.vocab_size == len(tokenizer) == 2048
        assert model.config.eos_token_id == tokenizer.eos_token_id
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
        assert "1+2=" in text and len(tokenizer(text)["input_ids"]) > 4, name


def test_the_same_seed_gives_the_same_weights_and_another_seed_other_weights(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.models.bpe import train_bpe

    tokenizer = train_bpe("chatml")
    a, b, c = (load_file(str(build_family("qwen3", tmp_path / s, tokenizer, seed=int(s[-1])) / "model.safetensors")) for s in ("a0", "b0", "c1"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_moe_routers_are_spread_so_that_rounding_cannot_swap_experts(family_dirs):
    """Over 4,096 tokens no token's 2nd and 3rd experts lie within 1e-4 (rounding differences between two MoE
    implementations are ~1e-6), and the median margin is far above the default init's (~0.08)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs["qwen3-moe"], dtype=torch.float32)
    margins = []

    def margin(module, args, _out):
        logits = torch.nn.functional.linear(args[0], module.weight).sort(-1, descending=True).values
        margins.append((logits[..., 1] - logits[..., 2]).flatten())

    for name, module in model.named_modules():
        if name.endswith(".mlp.gate"):
            module.register_forward_hook(margin)
    with torch.no_grad():
        model(torch.randint(8, 2048, (16, 128), generator=torch.Generator().manual_seed(1)))
    margins = torch.cat(margins)
    assert margins.numel() == 2 * 16 * 128
    assert float(margins.min()) > 1e-4 and float(margins.median()) > 1.0


def test_an_unknown_family_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown model family 'gpt2'.*qwen2, qwen2-untied"):
        family_config("gpt2", None)


def test_family_shape_changes_the_shared_shape_and_derives_the_head_size():
    from asyncrl.models.families import family_shape

    wide = family_shape({"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2})
    assert (wide["hidden_size"], wide["num_hidden_layers"], wide["head_dim"], wide["intermediate_size"]) == (128, 4, 32, 128)
    assert family_shape() == family_shape({}) and family_shape()["head_dim"] == 32 and family_shape()["hidden_size"] == 64


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vocab_size": 10}, "unknown shape key 'vocab_size'"),
        ({"hidden_size": 0}, "hidden_size = 0 is not a positive integer"),
        ({"hidden_size": 100, "num_attention_heads": 3}, "num_attention_heads = 3 does not divide hidden_size = 100"),
        ({"num_attention_heads": 2, "num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 2"),
    ],
)
def test_family_shape_refuses_what_cannot_be_built_or_served_naming_the_key(changes, message):
    from asyncrl.models.families import family_shape

    with pytest.raises(ValueError, match=message):
        family_shape(changes)
