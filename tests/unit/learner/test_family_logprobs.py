"""The learner's log-probs equal transformers' own `model(input_ids).logits` log-softmax for every model family
(fp32, <= 1e-5), including what a family does after its final hidden state (Gemma 2's logit soft-capping)."""

import pytest
import torch

from asyncrl.algo.sampling import RAW
from asyncrl.learner.policy import PolicyModel, load_causal_lm
from asyncrl.models.families import FAMILIES
from tests.families import build_families

IDS = torch.tensor([[7, 301, 1500, 22, 919, 64, 1024, 5, 2047, 333, 76, 1800, 12, 640, 98, 1201, 44, 700]])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return build_families(tmp_path_factory.mktemp("families"))


def _learner(policy: PolicyModel) -> torch.Tensor:
    with torch.no_grad():
        return policy(IDS, torch.ones_like(IDS), torch.arange(IDS.shape[1])[None], RAW)[0, :-1]


def _transformers(model) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=IDS).logits[0, :-1].float(), -1)
    return logprobs.gather(-1, IDS[0, 1:, None])[:, 0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_learner_logprobs_equal_transformers_for_each_family(family_dirs, name):
    from transformers import AutoModelForCausalLM

    # transformers' SDPA path drops Gemma 2's attention soft-capping; its eager path is the model's definition.
    eager = {"attn_implementation": "eager"} if name == "gemma2" else {}
    reference = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32, **eager)
    policy = PolicyModel(load_causal_lm(str(family_dirs[name])))
    assert len(policy.decoder_layers) == 2
    diff = float((_learner(policy) - _transformers(reference)).abs().max())
    print(f"{name}: max |learner - transformers| = {diff:.2e}")
    assert diff <= 1e-5


def test_gemma2s_soft_capping_is_applied_by_the_learner(family_dirs):
    """Both caps change the log-probs far beyond the tolerance, so the equality above can fail: without the
    final cap (30) they move by > 1e-3, with transformers' SDPA (no attention cap, 50) by > 1e-4."""
    from transformers import AutoModelForCausalLM

    causal_lm = load_causal_lm(str(family_dirs["gemma2"]))
    assert causal_lm.config._attn_implementation == "eager"
    learner = _learner(PolicyModel(causal_lm))
    sdpa = AutoModelForCausalLM.from_pretrained(family_dirs["gemma2"], dtype=torch.float32, attn_implementation="sdpa")
    assert float((learner - _transformers(sdpa)).abs().max()) > 1e-4
    causal_lm.config.final_logit_softcapping = None
    assert float((learner - _learner(PolicyModel(causal_lm))).abs().max()) > 1e-3


def test_a_model_without_a_decoder_stack_is_refused_naming_its_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))  # blocks in `transformer.h`
    with pytest.raises(ValueError, match="GPT2LMHeadModel: the learner needs a decoder stack"):
        PolicyModel(gpt2)


def test_a_model_that_scales_its_logits_is_refused():
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, logits_scaling=4.0)
    with pytest.raises(ValueError, match=r"GraniteForCausalLM: the learner does not apply the logit scaling \['logits_scaling'\]"):
        PolicyModel(GraniteForCausalLM(config))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_what_engines_are_sent_has_the_checkpoints_names_and_tensors(family_dirs, name):
    """The weight sync sends the layout on disk (transformers keeps Qwen3-MoE's experts fused in memory): the same
    names and tensors as the family's safetensors file, plus the tied head of a tied model."""
    from safetensors.torch import load_file

    from asyncrl.learner.export import checkpoint_layout, hf_state_dict

    causal_lm = load_causal_lm(str(family_dirs[name]))
    full = {f"causal_lm.{k}": v for k, v in causal_lm.state_dict().items()}
    sent = checkpoint_layout(causal_lm, hf_state_dict(full, causal_lm.config.tie_word_embeddings))
    on_disk = load_file(str(family_dirs[name] / "model.safetensors"))
    if causal_lm.config.tie_word_embeddings:
        on_disk["lm_head.weight"] = on_disk["model.embed_tokens.weight"]
    assert sorted(sent) == sorted(on_disk)
    assert all(torch.equal(sent[k], on_disk[k]) for k in on_disk)
    if name == "qwen3-moe":  # fused in memory, one tensor per expert and projection on disk and on the wire
        assert "causal_lm.model.layers.0.mlp.experts.gate_up_proj" in full
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent
