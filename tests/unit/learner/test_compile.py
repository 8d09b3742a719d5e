"""`learner.compile`: compiled decoder layers give the eager gradients, leave the module as it was, and draw no
random numbers at set-up."""

import functools

import pytest
import torch

from asyncrl.algo.recipes import compute_policy_loss, resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch
from asyncrl.learner.state import build_train_state

from .helpers import random_groups


def _state(model_dir, compile_: bool):
    torch.manual_seed(0)
    state = build_train_state(LearnerConfig(compile=compile_, lr=1e-3), str(model_dir), torch.device("cpu"))
    # After set-up: the random state, and whether the warm-up left gradients behind.
    return state, (torch.random.get_rng_state(), any(p.grad is not None for p in state.policy.parameters()))


@pytest.fixture(scope="module")
def states(tiny_model_dir):
    return _state(tiny_model_dir, False), _state(tiny_model_dir, True)


def _loss_and_grads(policy, batch, recipe):
    policy.zero_grad(set_to_none=True)
    logprobs = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    loss, _ = compute_policy_loss(
        recipe, logprobs, logprobs.detach(), batch.rollout_logprobs, batch.advantages, batch.loss_mask, batch.token_weights, batch.group_ids
    )
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in policy.named_parameters()}


def test_compiled_layers_give_the_eager_loss_and_gradients(states):
    (eager, _), (compiled, _) = states
    assert all(isinstance(layer.forward, functools.partial) for layer in compiled.policy.decoder_layers)
    recipe = resolve_recipe("grpo")
    # Rows of different lengths: the batch is padded (the mask path the warm-up compiled first).
    batch = build_batch(random_groups(num_groups=3, group_size=2, seed=7), recipe)
    assert not bool(batch.attention_mask.all())
    loss, grads = _loss_and_grads(eager.policy, batch, recipe)
    loss_c, grads_c = _loss_and_grads(compiled.policy, batch, recipe)
    assert loss_c == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grads_c[name], grad, rtol=1e-4, atol=1e-6), name
    assert any(float(g.abs().max()) > 1e-3 for g in grads.values())  # the comparison is of real gradients


def test_passes_without_gradients_run_the_eager_layers(states):
    (eager, _), (compiled, _) = states
    batch = build_batch(random_groups(num_groups=2, group_size=2, seed=3), resolve_recipe("grpo"))
    with torch.no_grad():
        args = (batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        assert torch.equal(compiled.policy(*args), eager.policy(*args))


def test_a_packed_micro_batch_of_several_bins_runs_the_graphs_built_at_set_up(states):
    """The warm-up's packed micro-batches of one and two bins leave nothing to compile in a run (a dimension of size 1
    is specialized: with a one-bin warm-up the first real micro-batch compiled again inside the run's clock)."""
    from asyncrl.learner.packing import packed_micro_batches

    _, (compiled, _) = states
    batch = build_batch(random_groups(num_groups=24, group_size=4, seed=5), resolve_recipe("grpo"))
    micro = packed_micro_batches(batch, 4 * 128, share=True)[0]
    assert micro.layout is not None and micro.layout.input_ids.shape[0] >= 3
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.policy(micro.input_ids, micro.attention_mask, micro.position_ids, RAW, micro.layout).sum().backward()
    compiled.policy.zero_grad(set_to_none=True)


def test_compiling_keeps_names_and_the_random_state(states):
    (eager, (rng, _)), (compiled, (rng_c, grads_left)) = states
    assert list(compiled.policy.state_dict()) == list(eager.policy.state_dict())
    assert torch.equal(rng_c, rng)  # the warm-up passes drew nothing the run would see
    assert not grads_left


def test_without_a_cxx_compiler_compiling_fails_at_once_naming_the_key(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, clang++ or c++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match=r"learner\.compile needs a C\+\+ compiler.*g\+\+, clang\+\+, c\+\+.*learner\.compile=false"):
        build_train_state(LearnerConfig(compile=True), str(tiny_model_dir), torch.device("cpu"))


def test_compiled_bf16_layers_compute_with_the_bf16_copies(tiny_model_dir, states):
    """One bf16 rank (`policy.cast_layers`, no FSDP): the compiled layers use the bf16 copies the hooks put in
    place, not the fp32 masters the module had when it was traced. A master's gradient then comes from a bf16
    gradient through the cast, so each of its values is a bf16 number; one computed from the fp32 masters is not."""
    from asyncrl.learner.policy import cast_layers

    def bf16(module):
        module.transformer.set_attn_implementation("eager")
        cast_layers(module, torch.bfloat16)

    def layer_grads_in_bf16(grads: dict) -> float:
        layer = [g for name, g in grads.items() if ".layers." in name]
        return sum(int((g == g.to(torch.bfloat16).float()).sum()) for g in layer) / sum(g.numel() for g in layer)

    torch.manual_seed(0)
    eager, compiled = (build_train_state(LearnerConfig(compile=c, lr=1e-3), str(tiny_model_dir), torch.device("cpu"), bf16) for c in (False, True))
    recipe = resolve_recipe("grpo")
    batch = build_batch(random_groups(num_groups=3, group_size=2, seed=7), recipe)
    loss, grads = _loss_and_grads(eager.policy, batch, recipe)
    loss_c, grads_c = _loss_and_grads(compiled.policy, batch, recipe)
    _, grads_fp32 = _loss_and_grads(states[0][0].policy, batch, recipe)
    assert layer_grads_in_bf16(grads) == layer_grads_in_bf16(grads_c) == 1.0
    assert layer_grads_in_bf16(grads_fp32) < 0.1
    assert loss_c == pytest.approx(loss, rel=0.02)
