import pytest
import torch

from asyncrl.algo.advantages import masked_whiten
from asyncrl.algo.recipes import compute_policy_loss, resolve_recipe
from asyncrl.algo.sampling import RAW, SamplingDistribution
from asyncrl.learner.batch import build_batch, dummy_microbatch, micro_batches
from asyncrl.learner.policy import PolicyModel, ValueModel, load_causal_lm
from asyncrl.learner.merge import Update, apply_whitening, mean_over_updates, merge_metrics, update_metrics, whitening_moments

from .helpers import random_groups


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return PolicyModel(load_causal_lm(str(tiny_model_dir), torch.float32))


def test_learner_logprobs_equal_a_plain_transformers_forward_with_temperature(policy, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    batch = build_batch(random_groups(num_groups=2, group_size=2, seed=4), resolve_recipe("dapo"))
    temperature = 0.7
    with torch.no_grad():
        learner = policy(batch.input_ids, batch.attention_mask, batch.position_ids, SamplingDistribution(temperature))
        for b in range(batch.num_rows):
            n = int(batch.seq_lens[b])
            ids = batch.input_ids[b : b + 1, :n]  # unpadded, one sequence: no mask involved
            logits = reference(input_ids=ids).logits[0].float() / temperature
            expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(learner[b, : n - 1], expected, atol=1e-6, rtol=0), b
            # The same numbers at temperature 1 differ: the temperature really is applied.
            assert not torch.allclose(policy(ids, torch.ones_like(ids), torch.arange(n)[None], RAW)[0, : n - 1], expected)


def _gradients(model, mbs, recipe):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        logprobs = model(mb.input_ids, mb.attention_mask, mb.position_ids, RAW)
        loss, _ = compute_policy_loss(
            recipe, logprobs, logprobs.detach(), mb.rollout_logprobs, mb.advantages, mb.loss_mask, mb.token_weights, mb.group_ids
        )
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["cispo", "gvpo", "grpo"])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(policy, preset):
    recipe = resolve_recipe(preset, loss="reinforce") if preset == "grpo" else resolve_recipe(preset)
    batch = build_batch(random_groups(num_groups=4, group_size=3, seed=5), recipe)
    keep_groups = preset == "gvpo"
    whole_loss, whole = _gradients(policy, [batch], recipe)
    mbs = micro_batches(batch, 12, keep_groups) + [dummy_microbatch(batch.num_groups)]
    assert len(mbs) >= 4
    split_loss, split = _gradients(policy, mbs, recipe)
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert max(float((whole[n] - split[n]).abs().max()) for n in whole) < 1e-6
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-3  # the gradient is not trivially zero


def test_value_model_starts_from_the_policy_trunk(tiny_model_dir):
    causal_lm = load_causal_lm(str(tiny_model_dir), torch.float32)
    critic = ValueModel(load_causal_lm(str(tiny_model_dir), torch.float32))
    assert torch.equal(critic.trunk.layers[0].mlp.up_proj.weight, causal_lm.model.layers[0].mlp.up_proj.weight)
    ids = torch.tensor([[1, 5, 6, 7]])
    assert critic(ids, torch.ones_like(ids), torch.arange(4)[None]).shape == (1, 4)


def test_whitening_with_global_moments_equals_whole_batch_whitening():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    pieces = [(adv[:2], mask[:2]), (adv[2:3], mask[2:3]), (adv[3:], mask[3:])]
    moments = sum(whitening_moments([a], [m]) for a, m in pieces)
    got = torch.cat([apply_whitening([a], [m], moments)[0] for a, m in pieces])
    assert torch.allclose(got, masked_whiten(adv, mask), atol=1e-6)


def test_merge_metrics_sums_losses_takes_extremes_and_weights_means():
    parts = [({"pg_loss": 0.25, "clipfrac": 0.5, "mismatch_logprob_abs_diff_max": 1.0}, 1.0),
             ({"pg_loss": 0.5, "clipfrac": 0.0, "mismatch_logprob_abs_diff_max": 3.0}, 3.0)]
    # clipfrac: (0.5*1 + 0*3)/4 = 0.125
    assert merge_metrics(parts) == {"pg_loss": 0.75, "clipfrac": 0.125, "mismatch_logprob_abs_diff_max": 3.0}


def test_metrics_of_several_updates_are_their_plain_mean_and_extremes():
    parts = [{"pg_loss": 0.2, "clipfrac": 0.0, "ratio_max": 1.0}, {"pg_loss": 0.4, "clipfrac": 0.3, "ratio_max": 1.5}]
    assert mean_over_updates(parts) == pytest.approx({"pg_loss": 0.3, "clipfrac": 0.15, "ratio_max": 1.5})


def test_update_report_counts_taken_steps_and_the_kl_stop():
    updates = [
        Update(loss=0.5, grad_norm=1.0, stepped=True, clipfrac=0.0, approx_kl=0.0, metrics={}),
        Update(loss=0.25, grad_norm=2.0, stepped=True, clipfrac=0.1, approx_kl=0.02, metrics={}),
        Update(loss=0.125, grad_norm=0.0, stepped=False, clipfrac=0.3, approx_kl=0.01, metrics={}, stopped=True),
    ]
    report = update_metrics(updates)
    assert (report["updates"], report["kl_stopped"], report["skipped_step"]) == (2.0, 1.0, 0.0)
    assert [report[f"clipfrac_mb{i}"] for i in range(3)] == [0.0, 0.1, 0.3]
    assert [report[f"loss_mb{i}"] for i in range(3)] == [0.5, 0.25, 0.125]
    assert (report["approx_kl"], report["approx_kl_max"]) == (0.01, 0.02)  # the last one measured, the largest
    assert update_metrics(updates[:2])["kl_stopped"] == 0.0


def test_the_recipe_comes_from_the_algorithm_section_with_l_max_from_the_rollout_length():
    from asyncrl.config import validate_config
    from asyncrl.learner.pool import recipe_from_config

    cfg = validate_config({"algorithm": {"preset": "dr_grpo", "params": {"eps_high": 0.3}}, "rollout": {"max_tokens": 12}})
    recipe = recipe_from_config(cfg)
    assert (recipe.advantage, recipe.reduction, recipe.l_max, recipe.eps_high) == ("dr_grpo", "seq_mean_token_sum_norm", 12, 0.3)


def test_a_state_dict_before_the_first_step_does_not_change_that_step():
    """DCP's get_state_dict initialises a missing AdamW state with a zero step that counts; after
    `materialize_optimizer_state` the first real step is still the fresh-AdamW step lr * g / (|g| + eps)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from asyncrl.learner.state import materialize_optimizer_state

    def first_step(snapshot_first: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        module = torch.nn.Module()
        module.weight = weight
        optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0)
        materialize_optimizer_state(optimizer)
        if snapshot_first:
            get_optimizer_state_dict(module, optimizer)
        weight.grad = torch.tensor([0.5, -2.0])
        optimizer.step()
        return weight.detach()

    # Fresh AdamW, step 1: m_hat = g, v_hat = g^2 -> update = lr * sign(g) = [-0.1, +0.1].
    assert torch.allclose(first_step(False), torch.tensor([0.9, 2.1]), atol=1e-6)
    assert torch.equal(first_step(True), first_step(False))
