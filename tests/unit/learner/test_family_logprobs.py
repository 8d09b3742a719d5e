"""The learner's log-probs equal transformers' own `model(input_ids).logits` log-softmax for every model family
(fp32, <= 1e-5), including what a family does after its final hidden state (Gemma 2's logit soft-capping)."""

import dataclasses

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


@pytest.mark.parametrize("name,window", [(name, None) for name in FAMILIES] + [("mistral", 4), ("qwen3-moe", 4)])
def test_packed_and_shared_logprobs_equal_the_padded_ones_for_each_family(family_dirs, name, window):
    """Sequences of up to 20 tokens cross Gemma 2's sliding window of 8 (and the `window` set on Mistral and
    Qwen3-MoE, whose every layer slides): the packed masks apply the window on position ids."""
    import numpy as np

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.packing import packable, packed_micro_batches
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng = np.random.default_rng(0)
    groups = []
    for g in range(3):
        prompt = rng.integers(3, 2000, int(rng.integers(4, 11)))
        responses = [rng.integers(3, 2000, int(rng.integers(1, 11))) for _ in range(3)]
        groups.append(Group(f"g{g}", [make_trajectory(r, prompt_ids=prompt, group_id=f"g{g}") for r in responses]))
    batch = build_batch(groups, resolve_recipe("grpo"))
    causal_lm = load_causal_lm(str(family_dirs[name]))
    if window is not None:
        causal_lm.config.sliding_window = window
    policy = PolicyModel(causal_lm)
    assert packable(causal_lm) is None
    real = torch.arange(batch.input_ids.shape[1])[None] < batch.seq_lens[:, None] - 1
    with torch.no_grad():
        padded = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        for share in (False, True):
            (mb,) = packed_micro_batches(batch, 4096, share=share)
            packed = torch.zeros_like(padded)  # back in the batch's row order
            order = [batch.input_ids.tolist().index(row) for row in mb.input_ids.tolist()]
            packed[order] = policy(mb.input_ids, mb.attention_mask, mb.position_ids, RAW, mb.layout)
            diff = float((packed - padded)[real].abs().max())
            print(f"{name} window {window} share {share}: max |packed - padded| = {diff:.2e}")
            assert diff <= 1e-5
    if window is not None:  # the window matters here: without it the log-probs move
        causal_lm.config.sliding_window = None
        with torch.no_grad():
            unwindowed = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        assert float((unwindowed - padded)[real].abs().max()) > 1e-4


def test_replayed_routes_give_the_padded_logprobs_packed_and_shared(family_dirs):
    """MoE routing replay on the packed layout: each slot takes its row's routes (a shared prompt's are every
    sample's), drawn at random here so that they differ from the router's own choice and matter."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.packing import packed_micro_batches, shared_groups
    from asyncrl.learner.routing import replaying
    from asyncrl.testing import random_groups

    batch = build_batch(
        random_groups(num_groups=3, group_size=3, seed=2, vocab=2000, shared_prompts=True), resolve_recipe("grpo")
    )
    policy = PolicyModel(load_causal_lm(str(family_dirs["qwen3-moe"])))
    # Prompts to experts (0, 1), responses to (3, 2): the 4 experts' top-2 of 2 MoE layers.
    in_prompt = torch.arange(batch.input_ids.shape[1])[None] < batch.prompt_lens[:, None]
    routes = torch.where(in_prompt[..., None, None], torch.tensor([0, 1]), torch.tensor([3, 2]))
    routes = routes.expand(-1, -1, 2, -1).to(torch.int16)
    batch = dataclasses.replace(batch, routed_experts=routes)
    assert len(shared_groups(batch)) == 3
    with torch.no_grad(), replaying(policy, routes):
        padded = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    with torch.no_grad():
        own = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    real = torch.arange(batch.input_ids.shape[1])[None] < batch.seq_lens[:, None] - 1
    assert float((own - padded)[real].abs().max()) > 1e-4  # the routes matter
    (mb,) = packed_micro_batches(batch, 4096, share=True)
    order = [batch.input_ids.tolist().index(row) for row in mb.input_ids.tolist()]
    with torch.no_grad(), replaying(policy, mb.layout.routed_experts):
        packed = policy(mb.input_ids, mb.attention_mask, mb.position_ids, RAW, mb.layout)
    assert float((packed - padded[order])[real[order]].abs().max()) <= 1e-5
