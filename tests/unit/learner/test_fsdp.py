"""`learner.fsdp: always` on one rank (a real gloo group of one, in this process): the policy is FSDP2-wrapped and
computes what the plain module computes (log-probs, gradients, a step, in fp32; in bf16 what `cast_layers` does),
and its sharded state checkpoints and resumes, wrapped or not. `learner.rank_memory_gb`: the train state per rank
from the parameter shapes, checked before anything starts."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch

from .helpers import random_groups

RECIPE = resolve_recipe("cispo")


def _state(tiny_model_dir, mesh, fsdp: str, dtype=torch.float32, **config):
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state

    cfg = LearnerConfig(lr=1e-2, fsdp=fsdp, **config)
    torch.manual_seed(cfg.seed)
    return build_train_state(cfg, str(tiny_model_dir), torch.device("cpu"), lambda m: shard(m, mesh, dtype, fsdp))


def _rank_step(state, **config):
    import torch.distributed as dist

    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    return RankStep(state, LearnerConfig(lr=1e-2, **config), RECIPE, RAW, torch.device("cpu"), all_reduce)


def _full(module) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "full_tensor", lambda p=p: p)().detach().clone() for n, p in module.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def states(tiny_model_dir, mesh):
    return _state(tiny_model_dir, mesh, "auto"), _state(tiny_model_dir, mesh, "always")


def test_always_wraps_one_rank_with_fsdp2_and_auto_leaves_it_plain(states):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    plain, wrapped = states
    assert isinstance(wrapped.policy, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in wrapped.policy.decoder_layers)
    assert all(isinstance(p, DTensor) and p.device_mesh.size() == 1 for p in wrapped.policy.parameters())
    assert not isinstance(plain.policy, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.policy.parameters())


def test_a_wrapped_rank_gives_the_plain_gradients_and_step(states):
    plain, wrapped = states
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=1), RECIPE)
    loss_plain, grads_plain = _rank_step(plain).gradients(batch)
    loss_wrapped, grads_wrapped = _rank_step(wrapped).gradients(batch)
    grad_diff = max(float(abs(grads_plain[k] - grads_wrapped[k]).max()) for k in grads_plain)
    assert set(grads_plain) == set(grads_wrapped) and len(grads_plain) == 50
    assert max(float(abs(g).max()) for g in grads_plain.values()) > 1e-3  # a real gradient
    assert loss_wrapped == pytest.approx(loss_plain, abs=1e-7) and grad_diff < 1e-7
    with torch.no_grad():
        scores = [s.policy(batch.input_ids, batch.attention_mask, batch.position_ids, RAW) for s in states]
    real = torch.isfinite(scores[0])
    assert torch.equal(real, torch.isfinite(scores[1])) and (scores[0] - scores[1])[real].abs().max() < 1e-7

    before = _full(plain.policy)
    assert _max_diff(before, _full(wrapped.policy)) == 0.0
    stats = [_rank_step(s).train([batch], 0) for s in states]
    print(f"one rank wrapped vs plain: max |grad diff| {grad_diff:.1e}; step loss {stats[0].loss} vs {stats[1].loss}")
    assert stats[1].loss == pytest.approx(stats[0].loss, abs=1e-7)
    assert stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-6)
    after = _full(plain.policy)
    assert _max_diff(after, before) > 5e-3  # a real step of lr = 1e-2
    # Adam's first step is lr * g / (|g| + eps): where |g| is at float-rounding level it may differ (see
    # tests/integration/test_learner.py); wherever the gradient is clear of that, the weights agree.
    for name, value in _full(wrapped.policy).items():
        clear = torch.as_tensor(abs(grads_plain[name.removeprefix("causal_lm.")]) > 1e-5)
        assert (value - after[name])[clear].abs().max() < 1e-6, name


def test_a_wrapped_checkpoint_resumes_wrapped_and_plain(states, tiny_model_dir, mesh, tmp_path):
    from asyncrl.learner.checkpoint import load_train_state, save_train_state

    _, wrapped = states
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=2), RECIPE)
    _rank_step(wrapped).train([batch], 1)
    save_train_state(tmp_path, wrapped, rank=0, step=2)
    saved, moments = _full(wrapped.policy), _moments(wrapped)
    for fsdp in ("always", "never"):
        restored = _state(tiny_model_dir, mesh, fsdp)
        assert load_train_state(tmp_path, restored, rank=0) == 2
        assert _max_diff(saved, _full(restored.policy)) == 0.0
        assert _max_diff(moments, _moments(restored)) == 0.0 and len(moments) == 2 * len(saved)
        assert restored.scheduler.state_dict() == wrapped.scheduler.state_dict()
    # The resumed state takes the next step as the original does.
    next_batch = build_batch(random_groups(num_groups=3, group_size=3, seed=3), RECIPE)
    assert _rank_step(restored).train([next_batch], 2).loss == pytest.approx(
        _rank_step(wrapped).train([next_batch], 2).loss, abs=1e-7
    )


def _moments(state) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in state.policy.named_parameters()}
    return {
        f"{names[id(p)]}/{k}": getattr(v, "full_tensor", lambda v=v: v)().clone()
        for p, entry in state.optimizer.state.items()
        for k, v in entry.items()
        if k in ("exp_avg", "exp_avg_sq")
    }


def test_wrapped_bf16_computes_what_cast_layers_does(tiny_model_dir, mesh):
    """The plain rank's bf16 (`cast_layers`) is documented bit-equal to FSDP2's mixed precision: against the real
    wrap, through a whole step (log-probs, gradient norm, updated fp32 masters)."""
    from torch.distributed.fsdp import FSDPModule

    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=4), RECIPE)
    results = []
    for fsdp in ("never", "always"):
        state = _state(tiny_model_dir, mesh, fsdp, torch.bfloat16)
        assert isinstance(state.policy, FSDPModule) == (fsdp == "always")
        stats = _rank_step(state).train([batch], 0)
        results.append((stats, _full(state.policy)))
    (plain, plain_after), (wrapped, wrapped_after) = results
    assert all(p.dtype == torch.float32 for p in wrapped_after.values())
    assert wrapped.metrics["mismatch_training_ppl"] == plain.metrics["mismatch_training_ppl"]
    assert wrapped.grad_norm == plain.grad_norm and wrapped.loss == plain.loss
    assert _max_diff(plain_after, wrapped_after) == 0.0


def test_fsdp_never_with_several_ranks_is_a_config_error_naming_the_keys():
    from pydantic import ValidationError

    from asyncrl.learner.policy import uses_fsdp

    with pytest.raises(ValidationError, match=r"learner.fsdp = 'never'.*learner.num_ranks = 2"):
        LearnerConfig(fsdp="never", num_ranks=2)
    assert [uses_fsdp(n, f) for f in ("auto", "always") for n in (1, 2)] == [False, True, True, True]
    assert not uses_fsdp(1, "never")
    with pytest.raises(ValueError, match="needs one rank"):
        uses_fsdp(2, "never")


def test_the_rank_memory_budget_names_the_figures_and_the_ranks_that_fit(tiny_model_dir):
    from asyncrl.learner.memory import check_rank_memory

    # tiny-0.3m: 247,872 parameters x 16 bytes = 3.97 MB on one rank, 1.98 MB on each of two.
    with pytest.raises(ValueError) as error:
        check_rank_memory(LearnerConfig(rank_memory_gb=0.003), str(tiny_model_dir))
    message = str(error.value)
    for part in ("learner.rank_memory_gb = 0.003", "learner.num_ranks = 1", "each rank needs 0.00397 GB",
                 "247,872 fp32 parameters", "0.000991 GB of parameters", "0.00198 of AdamW moments",
                 "It fits from learner.num_ranks = 2 (0.00198 GB per rank)"):  # fmt: skip
        assert part in message, (part, message)
    fits = check_rank_memory(LearnerConfig(rank_memory_gb=0.003, num_ranks=2), str(tiny_model_dir))
    assert fits is not None and fits.need == 247_872 * 8
    with pytest.raises(ValueError, match="No number of ranks fits: loading the whole fp32 model takes 0.000991 GB"):
        check_rank_memory(LearnerConfig(rank_memory_gb=0.0005), str(tiny_model_dir))
    critic = check_rank_memory(LearnerConfig(rank_memory_gb=1, critic=True), str(tiny_model_dir))
    assert critic is not None and critic.parameters == 247_872 + 247_872 + 64 + 1  # tied: the trunk is every weight


def test_a_wrapped_rank_holds_the_computed_shares(states, tiny_model_dir):
    from asyncrl.learner.memory import held_bytes, parameter_shapes, rank_need

    need = rank_need(parameter_shapes(str(tiny_model_dir)), 1)
    for state in states:
        held = held_bytes(state)
        assert held["param_bytes"] == need.params
        # AdamW: two fp32 moments per parameter, and a 4-byte step counter per tensor.
        assert held["optimizer_bytes"] == need.optimizer + 4 * 50


def test_the_rank_memory_budget_counts_the_reference_policy_sharded(tiny_model_dir):
    from asyncrl.learner.memory import check_rank_memory

    # tiny-0.3m: 247,872 parameters; the reference adds its fp32 weights, 4 bytes each, halved on two ranks.
    for ranks in (1, 2):
        plain = check_rank_memory(LearnerConfig(rank_memory_gb=1, num_ranks=ranks), str(tiny_model_dir))
        kl = check_rank_memory(LearnerConfig(rank_memory_gb=1, num_ranks=ranks), str(tiny_model_dir), reference=True)
        assert plain is not None and kl is not None and plain.reference == 0
        assert kl.reference == 247_872 * 4 // ranks and kl.state == plain.state + kl.reference
    with pytest.raises(ValueError, match=r"\+ 0.000991 of the reference policy per rank.*It fits from learner.num_ranks = 2"):
        check_rank_memory(LearnerConfig(rank_memory_gb=0.0035), str(tiny_model_dir), reference=True)


def test_the_rank_memory_budget_under_lora_counts_the_frozen_base_and_the_adapters_state(tiny_model_dir):
    from asyncrl.config import LoraConfig
    from asyncrl.learner.memory import check_rank_memory

    # tiny-0.3m (hidden 64, 2 heads of 32, 1 kv head, MLP 256, 4 layers): rank 4 on every projection is, per layer,
    # q/o 4*64 + 64*4 = 512 each, k/v 4*64 + 32*4 = 384 each, gate/up/down 4*64 + 256*4 = 1,280 each: 5,632, and
    # 22,528 in 4 layers. The base's 247,872 weights count 4 bytes, the adapters 16 (weight, grad, 2 moments).
    lora = LoraConfig(rank=4, alpha=8.0)
    need = check_rank_memory(LearnerConfig(rank_memory_gb=1, lora=lora), str(tiny_model_dir), reference=True)
    assert need is not None and (need.parameters, need.frozen) == (270_400, 247_872)
    assert (need.params, need.grads, need.optimizer) == (270_400 * 4, 22_528 * 4, 22_528 * 8)
    assert need.reference == 0  # the base model with the adapters off is the reference: no second copy
    assert need.need == 1_351_936 < 247_872 * 16
    two = check_rank_memory(LearnerConfig(rank_memory_gb=1, lora=lora, num_ranks=2), str(tiny_model_dir))
    assert two is not None and two.state == 1_351_936 // 2 and two.need == two.load == 1_081_600  # loading bounds it
    other = LearnerConfig(rank_memory_gb=1, lora=lora, reference_path=str(tiny_model_dir))
    named = check_rank_memory(other, str(tiny_model_dir), reference=True)
    assert named is not None and named.reference == 247_872 * 4  # `learner.reference_path`: a second model
    with pytest.raises(ValueError) as error:
        check_rank_memory(LearnerConfig(rank_memory_gb=0.0013, lora=lora), str(tiny_model_dir))
    for part in ("each rank needs 0.00135 GB", "270,400 fp32 parameters, 247,872 of them frozen",
                 "0.00108 GB of parameters + 9.01e-05 of gradients + 0.00018 of AdamW moments",
                 "It fits from learner.num_ranks = 2 (0.00108 GB per rank)"):  # fmt: skip
        assert part in str(error.value), (part, str(error.value))


def test_a_wrapped_lora_rank_holds_the_estimate(tiny_model_dir, mesh):
    from asyncrl.config import LoraConfig
    from asyncrl.learner.memory import held_bytes

    state = _state(tiny_model_dir, mesh, "always", lora=LoraConfig(rank=4, alpha=8.0))
    held = held_bytes(state)
    # the estimate of the test above: all 270,400 weights, AdamW moments of the 22,528 adapter parameters only
    # (and a 4-byte step counter per adapter tensor: A and B of 7 projections in 4 layers)
    assert held["param_bytes"] == 270_400 * 4
    assert held["optimizer_bytes"] == 22_528 * 8 + 4 * 56
