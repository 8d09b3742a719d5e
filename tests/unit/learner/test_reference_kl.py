"""The KL-to-reference term on one learner rank: a frozen reference policy's log-probs, the `kl_ref` metric and
the loss, checked against log-probs computed by hand from plain transformers forwards of the two models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch

from .helpers import random_groups

COEF = 0.1


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight moved by N(0, 0.05^2) noise, saved as a model folder."""
    from asyncrl.learner.policy import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    folder = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(folder)
    return folder


def _step(model_dir, reference_dir, mesh, estimator: str, fsdp: str = "never"):
    """A RankStep on the policy from `model_dir` with the reference from `reference_dir` (kl_coef = COEF)."""
    import torch.distributed as dist

    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_reference, build_train_state
    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    cfg = LearnerConfig(fsdp=fsdp)
    place = lambda m: shard(m, mesh, torch.float32, fsdp)  # noqa: E731
    torch.manual_seed(0)
    state = build_train_state(cfg, str(model_dir), torch.device("cpu"), place)
    reference = build_reference(str(reference_dir), torch.device("cpu"), place)
    recipe = resolve_recipe("cispo", kl_coef=COEF, kl_estimator=estimator)
    return RankStep(state, cfg, recipe, RAW, torch.device("cpu"), all_reduce, reference=reference)


def _hand_logprobs(model_dir, rows) -> torch.Tensor:
    """log pi(s[t+1] | s[:t+1]) in the batch's layout, one unpadded transformers forward per row, float64."""
    from asyncrl.learner.policy import load_causal_lm

    model = load_causal_lm(str(model_dir))
    out = torch.zeros(rows.input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for b, n in enumerate(rows.seq_lens.tolist()):
            ids = rows.input_ids[b, :n]
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
            out[b, : n - 1] = logp[:-1].gather(1, ids[1:, None])[:, 0]
    return out


def _rows(recipe):
    return build_batch(random_groups(num_groups=3, group_size=2, seed=3), recipe)


def test_at_the_start_the_reference_is_the_policy_so_kl_and_its_gradient_are_zero(tiny_model_dir, mesh):
    step = _step(tiny_model_dir, tiny_model_dir, mesh, "k3")
    rows = _rows(step.recipe)
    acc = step.accumulate(rows)
    step.state.optimizer.zero_grad(set_to_none=True)
    assert acc.metrics["kl_ref"] == 0.0
    assert acc.metrics["kl_loss"] == 0.0
    loss, grads = step.gradients(rows)
    plain_loss, plain_grads = dataclasses.replace(step, recipe=dataclasses.replace(step.recipe, kl_coef=0.0)).gradients(
        rows
    )
    assert loss == plain_loss
    for name, grad in grads.items():
        assert abs(grad - plain_grads[name]).max() == 0.0, name


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_a_perturbed_reference_matches_the_hand_computation(tiny_model_dir, perturbed_dir, mesh, estimator):
    step = _step(tiny_model_dir, perturbed_dir, mesh, estimator)
    rows = _rows(step.recipe)
    d = _hand_logprobs(tiny_model_dir, rows) - _hand_logprobs(perturbed_dir, rows)
    per_token = d if estimator == "k1" else torch.exp(-d) + d - 1  # |d| < 2.6 here: k3's clamp does not bind
    mask = rows.loss_mask
    assert 1e-3 < d[mask].abs().max() < 2.6  # the reference really differs; k3 stays inside its clamp
    hand_mean = float(per_token[mask].sum() / mask.sum())
    hand_reduced = float((per_token * rows.token_weights.double())[mask].sum())

    acc = step.accumulate(rows)
    step.state.optimizer.zero_grad(set_to_none=True)
    assert acc.metrics["kl_ref"] == pytest.approx(hand_mean, abs=1e-5)

    loss, _ = step.gradients(rows)
    plain_loss, _ = dataclasses.replace(step, recipe=dataclasses.replace(step.recipe, kl_coef=0.0)).gradients(rows)
    assert loss == pytest.approx(plain_loss + COEF * hand_reduced, abs=1e-6)
    assert loss != pytest.approx(plain_loss, abs=1e-6)


def test_the_reference_is_frozen_and_outside_the_train_state(tiny_model_dir, perturbed_dir, mesh):
    step = _step(tiny_model_dir, perturbed_dir, mesh, "k3", fsdp="always")
    assert step.reference is not None and not step.reference.training
    assert not any(p.requires_grad for p in step.reference.parameters())
    before = {k: v.full_tensor().clone() for k, v in step.reference.state_dict().items()}
    step.train([_rows(step.recipe)], 0)
    after = step.reference.state_dict()
    assert all(torch.equal(before[k], after[k].full_tensor()) for k in before)
    optimized = {id(p) for group in step.state.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in step.reference.parameters()}


def test_a_checkpoint_holds_no_reference_and_a_resumed_step_measures_kl_to_the_starting_weights(
    tiny_model_dir, mesh, tmp_path
):
    """What a resumed run does: the train state from the checkpoint, the reference rebuilt from the model folder."""
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner.checkpoint import load_train_state, save_train_state

    step = _step(tiny_model_dir, tiny_model_dir, mesh, "k3")
    rows = _rows(step.recipe)
    first = step.train([rows], 0)
    save_train_state(tmp_path, step.state, 0, 1)
    saved = dcp.FileSystemReader(str(tmp_path / "learner")).read_metadata().state_dict_metadata
    assert saved and not any("reference" in key for key in saved)
    assert all(key.startswith(("policy.", "critic.")) for key in saved)

    resumed = _step(tiny_model_dir, tiny_model_dir, mesh, "k3")
    load_train_state(tmp_path, resumed.state, 0)
    acc = resumed.accumulate(rows)
    assert first.metrics["kl_ref"] == 0.0 and acc.metrics["kl_ref"] > 1e-6  # the policy moved, the reference did not
    assert acc.metrics["kl_ref"] == step.accumulate(rows).metrics["kl_ref"]  # as if the run had never stopped


def test_with_several_updates_the_reference_runs_once_per_micro_batch_of_the_batch(tiny_model_dir, perturbed_dir, mesh):
    """Two mini-batches, two epochs: four updates over two micro-batches, the reference forward twice (not four
    times); its log-probs are the ones every update's KL term uses."""
    step = _step(tiny_model_dir, perturbed_dir, mesh, "k3")
    step = dataclasses.replace(step, config=step.config.model_copy(update={"epochs": 2}))
    calls = []
    forward = step.reference.forward
    step.reference.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    shards = [build_batch(random_groups(num_groups=2, group_size=2, seed=s), step.recipe) for s in (3, 4)]
    stats = step.train(shards, 0)
    assert stats.metrics["updates"] == 4.0 and len(calls) == 2 and stats.metrics["kl_ref"] > 0


BETA = 0.5


def test_kl_in_reward_adds_minus_beta_k1_to_the_token_rewards_of_gae(tiny_model_dir, perturbed_dir, mesh):
    """GAE with gamma = lam = 1 (no whitening): A_t = sum_{s >= t} r_s - V(s_t) (+ the same bootstrap), so the KL
    reward changes each advantage by -beta * the sum of k1 = log pi_old - log pi_ref over the row's loss tokens from
    t on, whatever the critic's values. pi_old is the policy before the update; both log-probs are computed here by
    hand (plain transformers forwards)."""
    import torch.distributed as dist

    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_reference, build_train_state
    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    cfg = LearnerConfig(fsdp="never", critic=True)
    place = lambda m: shard(m, mesh, torch.float32, "never")  # noqa: E731
    torch.manual_seed(0)
    state = build_train_state(cfg, str(tiny_model_dir), torch.device("cpu"), place)
    reference = build_reference(str(perturbed_dir), torch.device("cpu"), place)
    recipe = resolve_recipe(advantage="gae", loss="ppo", reduction="token_mean", gamma=1.0, lam=1.0, kl_in_reward_coef=BETA)
    step = RankStep(state, cfg, recipe, RAW, torch.device("cpu"), all_reduce, reference=reference)
    plain = dataclasses.replace(step, recipe=dataclasses.replace(recipe, kl_in_reward_coef=0.0))
    rows = _rows(recipe)

    with_kl, without = step.accumulate(rows, policy=False).batch, plain.accumulate(rows, policy=False).batch
    (mb,) = with_kl.micro_batches
    k1 = _hand_logprobs(tiny_model_dir, mb) - _hand_logprobs(perturbed_dir, mb)
    mask = mb.loss_mask.bool()
    k1 = torch.where(mask, k1, 0.0)
    expected = torch.where(mask, -BETA * k1.flip(-1).cumsum(-1).flip(-1), 0.0)
    assert 1e-3 < k1.abs().max()  # the reference really differs
    change = with_kl.advantages[0].double() - without.advantages[0].double()
    assert change.numpy() == pytest.approx(expected.numpy(), abs=1e-5)
    # The last loss token of each row: its change is -beta * its own k1 only.
    last = [int(torch.nonzero(row)[-1]) for row in mask]
    assert [float(change[b, t]) for b, t in enumerate(last)] == pytest.approx([-BETA * float(k1[b, t]) for b, t in enumerate(last)], abs=1e-5)
