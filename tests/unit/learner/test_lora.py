"""`learner.lora`: config validation, adapters as the only trained state, the step's loss and reduction unchanged
(at B = 0 the adapters' gradients are the full fine-tuning gradients projected: dL/dB = scale * dL/dW A^T), merged
weights, checkpoint/resume of the adapters and their optimizer, and a PEFT export that `peft` loads."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig, LoraConfig
from asyncrl.learner.batch import build_batch

from .helpers import random_groups

RECIPE = resolve_recipe("grpo")
LORA = {"rank": 4, "alpha": 8.0}
SCALE = 2.0  # alpha / rank
NUM_LAYERS = 4  # tiny-0.3m
PROBE = torch.tensor([[1, 4, 9, 14, 5, 15, 7, 3, 12, 6, 11, 8, 13, 10]])


@pytest.fixture(autouse=True, scope="module")
def _group(mesh):
    """The step all-reduces over a real gloo group of one (`mesh` makes it)."""


def _state(model_dir, place=lambda module: None, **config):
    from asyncrl.learner.state import build_train_state

    torch.manual_seed(0)
    return build_train_state(LearnerConfig(lr=1e-2, **config), str(model_dir), torch.device("cpu"), place)


def _step(state, **config):
    import torch.distributed as dist

    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    return RankStep(state, LearnerConfig(lr=1e-2, **config), RECIPE, RAW, torch.device("cpu"), all_reduce)


def _logprobs(policy) -> torch.Tensor:
    with torch.no_grad():
        return policy(PROBE, torch.ones_like(PROBE), torch.arange(PROBE.shape[1])[None], RAW)


def _randomize_b(policy, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


@pytest.mark.parametrize(
    "lora, fragment",
    [
        ({"rank": 0}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": ["qkv"]}, "learner.lora.target_modules"),
        ({"target_modules": []}, "learner.lora.target_modules"),
    ],
)
def test_bad_lora_settings_name_the_key(lora, fragment):
    with pytest.raises(ValidationError, match=fragment):
        LearnerConfig.model_validate({"lora": lora})


def test_lora_is_off_by_default_and_refused_with_megatron():
    assert LearnerConfig().lora is None
    with pytest.raises(ValidationError, match="megatron does not support learner.lora"):
        LearnerConfig(training_backend="megatron", lora=LoraConfig())


def test_a_target_missing_from_the_model_is_named():
    from torch import nn

    from asyncrl.learner.lora import add_adapters

    layers = nn.ModuleList([nn.ModuleDict({"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4)})])
    with pytest.raises(ValueError, match=r"learner.lora.target_modules: \['v_proj'\] are not linear layers"):
        add_adapters(layers, LoraConfig(target_modules=["q_proj", "v_proj"]))


def test_only_the_adapters_train_and_at_b_zero_the_policy_is_the_base_model(tiny_model_dir):
    plain, adapted = _state(tiny_model_dir), _state(tiny_model_dir, lora=LORA)
    trained = {n for n, p in adapted.policy.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 7 * NUM_LAYERS and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in trained)
    in_optimizer = [p for group in adapted.optimizer.param_groups for p in group["params"]]
    assert len(in_optimizer) == len(trained) and all(p.requires_grad for p in in_optimizer)
    # q_proj of the tiny model: hidden 64 -> 4 x 64 adapter pair
    a = dict(adapted.policy.named_parameters())["causal_lm.model.layers.0.self_attn.q_proj.lora_A.weight"]
    bound = float(a.detach().abs().max())
    assert a.shape == (4, 64) and 0.05 < bound <= 64**-0.5
    assert torch.equal(_logprobs(plain.policy), _logprobs(adapted.policy))


def test_the_step_reduction_is_unchanged_adapter_gradients_project_the_full_gradient(tiny_model_dir):
    """dL/dB = scale * dL/dW A^T and dL/dA = 0 at B = 0: the same loss, normalization and packing as full FT."""
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=1), RECIPE)
    plain, adapted = _state(tiny_model_dir), _state(tiny_model_dir, lora=LORA)
    loss, full = _step(plain).gradients(batch)
    loss_lora, grads = _step(adapted).gradients(batch)
    assert loss == pytest.approx(loss_lora, abs=1e-7)
    assert len(grads) == 2 * 7 * NUM_LAYERS
    params = dict(adapted.policy.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        a = params[f"causal_lm.{name}.lora_A.weight"].detach()
        expected = SCALE * torch.as_tensor(full[f"{name}.weight"]) @ a.T
        assert float(expected.abs().max()) > 1e-4  # a real gradient
        torch.testing.assert_close(torch.as_tensor(grads[f"{name}.lora_B.weight"]), expected, atol=1e-6, rtol=1e-4)
        assert float(abs(grads[f"{name}.lora_A.weight"]).max()) == 0.0


def test_a_step_moves_only_the_adapters_and_the_merged_weights_score_like_the_adapted_policy(tiny_model_dir):
    from asyncrl.learner.lora import is_adapter, merged
    from asyncrl.learner.policy import PolicyModel, load_causal_lm

    state = _state(tiny_model_dir, lora=LORA)
    before = {n: p.detach().clone() for n, p in state.policy.named_parameters()}
    stats = _step(state).train([build_batch(random_groups(num_groups=3, group_size=3, seed=2), RECIPE)], 0)
    assert stats.step == 1 and stats.grad_norm > 0
    after = dict(state.policy.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(is_adapter(n) for n in moved)
    assert any(n.endswith("lora_B.weight") for n in moved)
    plain = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    missing, unexpected = plain.load_state_dict(merged(state.policy.state_dict(), SCALE), strict=True)
    assert not missing and not unexpected
    lp, lp_merged = _logprobs(state.policy), _logprobs(plain)
    assert not torch.equal(lp, _logprobs(PolicyModel(load_causal_lm(str(tiny_model_dir)))))
    torch.testing.assert_close(lp, lp_merged, atol=1e-5, rtol=0)


def test_the_fsdp2_wrapped_policy_trains_its_adapters_like_the_plain_one(tiny_model_dir, mesh):
    from asyncrl.learner.policy import shard

    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=3), RECIPE)
    plain = _state(tiny_model_dir, lora=LORA, fsdp="never")
    wrapped = _state(tiny_model_dir, lambda m: shard(m, mesh, torch.float32, "always"), lora=LORA, fsdp="always")
    for state in (plain, wrapped):
        _step(state).train([batch], 0)
    full = {n: getattr(p, "full_tensor", lambda p=p: p)() for n, p in wrapped.policy.named_parameters()}
    for name, p in plain.policy.named_parameters():
        torch.testing.assert_close(full[name], p, atol=1e-6, rtol=0)


def test_checkpoint_resume_restores_the_adapters_and_their_optimizer(tiny_model_dir, mesh, tmp_path):
    from asyncrl.learner.checkpoint import load_train_state, save_train_state

    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=4), RECIPE)
    state = _state(tiny_model_dir, lora=LORA)
    _step(state).train([batch], 0)
    save_train_state(tmp_path, state, 0, 1)
    _step(state).train([batch], 1)
    resumed = _state(tiny_model_dir, lora=LORA)
    assert load_train_state(tmp_path, resumed, 0) == 1
    _step(resumed).train([batch], 1)
    for (name, p), q in zip(state.policy.named_parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert len(moments) == 2 * 7 * NUM_LAYERS and any(float(m.abs().max()) > 0 for m in moments)


def test_the_peft_export_loads_in_transformers_with_the_same_logprobs(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.lora import adapter_state, is_adapter, peft_config, write_adapter
    from asyncrl.learner.policy import hf_name

    state = _state(tiny_model_dir, lora=LORA)
    _randomize_b(state.policy)
    tensors = adapter_state({hf_name(k): v for k, v in state.policy.state_dict().items() if is_adapter(k)})
    assert len(tensors) == 2 * 7 * NUM_LAYERS
    write_adapter(tmp_path, tensors, peft_config(LoraConfig(**LORA), str(tiny_model_dir)))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path))
    with torch.no_grad():
        logits = model(PROBE).logits.float()
    peft_lp = torch.log_softmax(logits, -1)[0, :-1].gather(-1, PROBE[0, 1:, None])[:, 0]
    ours = _logprobs(state.policy)[0, :-1]
    assert float((ours - _logprobs(_state(tiny_model_dir).policy)[0, :-1]).abs().max()) > 1e-2  # the adapter acts
    torch.testing.assert_close(peft_lp, ours, atol=1e-5, rtol=0)


def test_with_the_adapters_off_the_policy_is_the_base_model_the_reference_of_a_lora_run(tiny_model_dir, mesh):
    from asyncrl.learner.lora import BaseModelView
    from asyncrl.learner.policy import shard

    base = _logprobs(_state(tiny_model_dir).policy)
    for fsdp in ("never", "always"):
        place = lambda m, f=fsdp: (_randomize_b(m), shard(m, mesh, torch.float32, f))  # noqa: E731 -- B != 0 first
        state = _state(tiny_model_dir, place, lora=LORA, fsdp=fsdp)
        adapted = _logprobs(state.policy)
        reference = BaseModelView(state.policy, state.policy.decoder_layers)
        assert list(reference.parameters()) == []  # nothing to optimize, checkpoint or export
        assert float((adapted - base)[0, :-1].abs().max()) > 1e-2
        torch.testing.assert_close(reference(PROBE, torch.ones_like(PROBE), torch.arange(14)[None], RAW), base)
        assert torch.equal(_logprobs(state.policy), adapted)  # the adapters are on again
