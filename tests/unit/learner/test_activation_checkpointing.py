"""`learner.activation_checkpointing`: the decoder layers recompute their activations in the backward. The log-probs,
loss, gradients and updated weights are exactly the plain path's (one plain rank in fp32, one FSDP2-wrapped rank in
a real gloo group of one, one bf16 rank with `cast_layers`, compiled layers, the critic), and a forward + backward
holds a fraction of the activations (`memory.forward_backward_peak`: torch's `MemTracker`, deterministic)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch

from .helpers import random_groups

RECIPE = resolve_recipe("cispo")


def _state(model_dir, place=lambda module: None, **config):
    from asyncrl.learner.state import build_train_state

    torch.manual_seed(0)
    return build_train_state(LearnerConfig(lr=1e-2, **config), str(model_dir), torch.device("cpu"), place)


def _sharded(mesh, dtype, fsdp):
    from asyncrl.learner.policy import shard

    return lambda module: shard(module, mesh, dtype, fsdp)


def _step(state):
    import torch.distributed as dist

    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    return RankStep(state, LearnerConfig(lr=1e-2), RECIPE, RAW, torch.device("cpu"), all_reduce)


def _full(module) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "full_tensor", lambda p=p: p)().detach().clone() for n, p in module.named_parameters()}


def _run(state, batch):
    """(log-probs, loss, gradients, the step's loss and grad norm, the weights after it)."""
    with torch.no_grad():
        logprobs = state.policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
    loss, grads = _step(state).gradients(batch)
    stats = _step(state).train([batch], 0)
    metrics = {k: v for k, v in stats.metrics.items() if not k.endswith("_s")}  # not the timings
    return logprobs, loss, grads, (stats.loss, stats.grad_norm, metrics), _full(state.policy)


def _assert_same_run(plain, checkpointed):
    (lp, loss, grads, stats, after), (lp_c, loss_c, grads_c, stats_c, after_c) = plain, checkpointed
    assert torch.equal(lp, lp_c) and loss == loss_c and stats == stats_c
    assert grads.keys() == grads_c.keys() and len(grads) == 50
    assert all((grads[k] == grads_c[k]).all() for k in grads)
    assert max(float(abs(g).max()) for g in grads.values()) > 1e-3  # a real gradient
    assert after.keys() == after_c.keys() and all(torch.equal(after[k], after_c[k]) for k in after)


@pytest.mark.parametrize("mode", ["plain fp32", "fsdp fp32", "cast_layers bf16", "fsdp bf16"])
def test_checkpointed_layers_give_the_plain_logprobs_gradients_and_step(tiny_model_dir, mesh, mode):
    from torch.distributed.fsdp import FSDPModule

    fsdp = "always" if mode.startswith("fsdp") else "never"
    place = _sharded(mesh, torch.bfloat16 if "bf16" in mode else torch.float32, fsdp)
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=1), RECIPE)
    plain, checkpointed = (_state(tiny_model_dir, place, fsdp=fsdp, activation_checkpointing=c) for c in (False, True))
    assert isinstance(checkpointed.policy, FSDPModule) == (fsdp == "always")
    assert list(checkpointed.policy.state_dict()) == list(plain.policy.state_dict())  # the names stay
    _assert_same_run(_run(plain, batch), _run(checkpointed, batch))
    # The cast hooks ran again in the recomputation and put the fp32 masters back after it.
    assert all(p.dtype == torch.float32 for p in checkpointed.policy.parameters())
    assert all("_asyncrl_masters" not in layer.__dict__ for layer in checkpointed.policy.decoder_layers)


def test_the_recomputation_runs_in_the_backward(tiny_model_dir):
    """The layers' forwards run twice per forward + backward with checkpointing (once in the backward), once
    without; a pass without gradients runs them once."""
    batch = build_batch(random_groups(num_groups=2, group_size=2, seed=2), RECIPE)
    for checkpointing, calls in ((False, 1), (True, 2)):
        policy = _state(tiny_model_dir, activation_checkpointing=checkpointing).policy
        counts: list[int] = []
        policy.decoder_layers[0].register_forward_pre_hook(lambda *_, calls=counts: calls.append(1))
        out = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        torch.where(torch.isfinite(out), out, 0.0).sum().backward()
        with torch.no_grad():
            policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        assert len(counts) == calls + 1, checkpointing


def test_the_critic_trunk_is_checkpointed_with_the_same_gradients(tiny_model_dir):
    batch = build_batch(random_groups(num_groups=2, group_size=2, seed=3), RECIPE)
    grads = []
    for checkpointing in (False, True):
        critic = _state(tiny_model_dir, critic=True, activation_checkpointing=checkpointing).critic
        critic(batch.input_ids, batch.attention_mask, batch.position_ids).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in critic.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 50
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_compiled_checkpointed_layers_give_the_compiled_gradients(tiny_model_dir):
    batch = build_batch(random_groups(num_groups=2, group_size=2, seed=4), RECIPE)
    grads = []
    for checkpointing in (False, True):
        policy = _state(tiny_model_dir, compile=True, activation_checkpointing=checkpointing).policy
        out = policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW)
        torch.where(torch.isfinite(out), out, 0.0).sum().backward()
        grads.append({n: p.grad for n, p in policy.named_parameters()})
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert max(float(g.abs().max()) for g in grads[0].values()) > 1e-3


def test_a_sequence_over_the_activation_budget_fits_with_checkpointing(tiny_model_dir):
    """tiny-0.3m has 4 layers: each keeps only its input ([B, L, 64] fp32) instead of every intermediate, so the
    peak activations drop below a third. A budget between the two trains the sequence only with checkpointing."""
    from asyncrl.learner.memory import forward_backward_peak

    ids = (torch.arange(2 * 192).reshape(2, 192) % 13) + 3
    plain = forward_backward_peak(_state(tiny_model_dir).policy, ids)
    checkpointed = forward_backward_peak(_state(tiny_model_dir, activation_checkpointing=True).policy, ids)
    print(f"peak bytes plain {plain}, checkpointed {checkpointed}")
    assert checkpointed["activation"] < plain["activation"] / 3
    assert checkpointed["activation"] > 2 * 192 * 64 * 4 * 4  # at least the 4 layers' inputs: it measures something
    budget = (plain["total"] + checkpointed["total"]) // 2
    assert checkpointed["total"] < budget < plain["total"]
