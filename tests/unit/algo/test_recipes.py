"""The recipe layer: name resolution, entry points, and robustness of every loss x correction pair."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import recipes, registry
from asyncrl.algo.recipes import (
    Recipe,
    compute_advantages,
    compute_policy_loss,
    compute_token_weights,
    compute_value_loss,
    resolve_recipe,
)
from asyncrl.algo.reduction import reduction_weights

from .helpers import close, make_fpol

L_MAX = 4
NEEDS_L_MAX = {"l_max": L_MAX}


# ---------------------------------------------------------------- names and resolution


def test_names_module_imports_nothing_heavy():
    code = "import sys, asyncrl.algo.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("preset", registry.PRESETS)
def test_every_preset_resolves_to_its_components(preset):
    recipe = resolve_recipe(preset, **NEEDS_L_MAX)
    for key, value in registry.PRESET_COMPONENTS[preset].items():
        assert getattr(recipe, key) == value


def test_preset_numbers_follow_the_spec():
    assert resolve_recipe("dapo").eps_high == 0.28
    assert resolve_recipe("grpo").eps_high == 0.2
    assert (resolve_recipe("gspo").eps_low, resolve_recipe("gspo").eps_high) == (3e-4, 4e-4)
    assert resolve_recipe("scalerl").cispo_eps_max == 5.0
    sao = resolve_recipe("sao")
    assert (sao.advantage, sao.loss, sao.correction, sao.dis_eps_low, sao.dis_eps_high) == ("vapo", "reinforce", "dis", 0.3, 5.0)
    assert resolve_recipe("ppo_gae").whiten_advantages


def test_explicit_overrides_win_over_the_preset():
    # CISPO reads eps_high only in its band mode (cispo_eps_max = None).
    recipe = resolve_recipe("grpo", loss="cispo", correction="tis", eps_high=0.3, cispo_eps_max=None)
    assert (recipe.loss, recipe.correction, recipe.eps_high, recipe.reduction) == ("cispo", "tis", 0.3, "seq_mean_token_mean")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preset": "grpoo"}, "unknown preset 'grpoo' (did you mean 'grpo'?); valid: grpo, dr_grpo"),
        ({"loss": "cipso"}, "unknown loss 'cipso' (did you mean 'cispo'?); valid: ppo, cispo, gspo"),
        ({"advantage": "gea"}, "unknown advantage 'gea'"),
        ({"reduction": "token_sum"}, "valid: token_mean, seq_mean_token_mean"),
        ({"correction": "tiss"}, "(did you mean 'tis'?)"),
        ({"eps_hihg": 0.3}, "unknown recipe parameter(s) eps_hihg (did you mean 'eps_high'?)"),
        ({"preset": "dr_grpo"}, "needs l_max"),
        ({"dual_clip_c": 0.5}, "dual_clip_c must be > 1"),
        ({"correction": "dis", "denominator_after_rejection": True}, "depends on the current policy"),
    ],
)
def test_invalid_recipes_fail_naming_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError) as err:
        resolve_recipe(**kwargs)
    assert message in str(err.value)


def test_recipe_is_frozen_and_serialisable():
    recipe = resolve_recipe("cispo")
    with pytest.raises(AttributeError):
        recipe.loss = "ppo"  # type: ignore[misc]
    assert Recipe(**recipe.to_dict()) == recipe


def test_every_name_has_an_implementation():
    assert set(recipes._SURROGATES) == set(registry.LOSSES)
    assert set(registry.PRESET_PARAMS) <= set(registry.PRESETS)
    for preset, params in registry.PRESET_PARAMS.items():
        resolve_recipe(preset, **params)


# ---------------------------------------------------------------- compute_advantages


@pytest.mark.parametrize("advantage", registry.ADVANTAGES)
def test_every_advantage_estimator_returns_token_advantages_zero_at_pads(advantage):
    recipe = resolve_recipe(None, advantage=advantage)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    values = torch.where(mask, torch.full((4, 3), 0.3), torch.full((4, 3), float("nan")))
    adv, returns = compute_advantages(recipe, rewards, group_ids, mask, values)
    assert adv.shape == (4, 3) and adv.dtype == torch.float32 and torch.isfinite(adv).all()
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))
    assert (returns is not None) == (advantage in ("gae", "vapo"))
    assert adv[mask].abs().sum() > 0


def test_grpo_recipe_broadcasts_the_spec_advantages(fadv):
    rewards, group_ids = fadv
    mask = torch.ones(9, 2, dtype=torch.bool)
    adv, _ = compute_advantages(resolve_recipe("grpo"), rewards, group_ids, mask)
    close(adv[:3, 1], [1.154699, -0.577349, -0.577349])


def test_critic_advantages_refuse_to_run_without_values():
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(resolve_recipe("sao"), torch.ones(2), None, torch.ones(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------- shape_rewards


def test_overlong_shaping_adds_the_dapo_penalty_to_the_task_rewards():
    recipe = resolve_recipe("grpo", overlong_max_length=10, overlong_cache_length=4, overlong_penalty_factor=0.5)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    # expected length 10 - 4 = 6: |y| <= 6 -> 0; 8 -> (6 - 8) / 4 * 0.5 = -0.25; 10 -> -0.5; beyond -> -0.5.
    shaped = recipes.shape_rewards(recipe, rewards, [6, 8, 9, 10, 40])
    close(shaped, [1.0, 0.75, -0.375, 0.5, -0.5])  # 9 -> (6 - 9) / 4 * 0.5 = -0.375
    assert recipes.shape_rewards(resolve_recipe("grpo"), rewards, [6, 8, 9, 10, 40]) is rewards


def test_dapo_preset_shapes_with_the_paper_lengths():
    recipe = resolve_recipe("dapo")
    assert (recipe.overlong_max_length, recipe.overlong_cache_length) == (20480, 4096)
    # docs/algorithms.md#reward-shaping-and-filters: |y| = 18000 -> (16384 - 18000) / 4096 = -0.394531.
    close(recipes.shape_rewards(recipe, torch.zeros(2), [16384, 18000]), [0.0, -0.394531])


# ---------------------------------------------------------------- compute_policy_loss


def run(recipe, pol, group_ids=None, ref=None):
    """The policy loss of `pol` as one whole optimizer batch."""
    weights = compute_token_weights(recipe, pol.mask, group_ids, pol.old, pol.rollout)
    tis_stats = recipes.tis_normalizer_stats(recipe, pol.mask, pol.old, pol.rollout) if recipe.normalizes_tis else None
    return compute_policy_loss(recipe, pol.logp, pol.old, pol.rollout, pol.adv, pol.mask, weights, group_ids, ref, tis_stats)


def test_grpo_preset_is_ppo_with_seq_mean_token_mean(fpol):
    loss, metrics = run(resolve_recipe("grpo"), fpol)
    close(loss, 0.505402)
    assert metrics["pg_loss"] == pytest.approx(0.505402, abs=1e-6)
    assert metrics["clipfrac"] == pytest.approx(3 / 11)


def test_denominator_after_rejection_counts_only_kept_tokens(fpol):
    kwargs = dict(advantage="grpo", loss="ppo", reduction="token_mean", correction="mis", dual_clip_c=3.0, mis_lower=0.5)
    loss, _ = run(resolve_recipe(None, denominator_after_rejection=True, **kwargs), fpol)
    close(loss, 0.828305)  # docs/algorithms.md#mis: denominator 8
    loss_original, _ = run(resolve_recipe(None, **kwargs), make_fpol())
    close(loss_original, 0.828305 * 8 / 11)


def test_kl_term_is_added_with_its_coefficient(fpol):
    ref = fpol.old - 0.1
    base, _ = run(resolve_recipe("grpo"), make_fpol(), ref=ref)
    with_kl, metrics = run(resolve_recipe("grpo", kl_coef=0.5, kl_estimator="k1"), fpol, ref=ref)
    assert "kl_loss" in metrics
    close(with_kl - base, 0.5 * metrics["kl_loss"], atol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(resolve_recipe("grpo", kl_coef=0.5), make_fpol())


LOSS_CORRECTION_PAIRS = [(loss, corr) for loss in registry.LOSSES for corr in registry.CORRECTIONS]


@pytest.mark.parametrize("loss, correction", LOSS_CORRECTION_PAIRS)
def test_masked_garbage_never_reaches_loss_or_gradient(loss, correction, fpol, fpol_garbage_pads):
    recipe = resolve_recipe(None, advantage="grpo", loss=loss, reduction="seq_mean_token_mean", correction=correction)
    groups = torch.tensor([0, 0, 1])
    clean, _ = run(recipe, fpol, groups)
    dirty, metrics = run(recipe, fpol_garbage_pads, groups)
    assert torch.isfinite(dirty) and all(v == v for v in metrics.values())
    close(dirty, clean.item(), atol=1e-7)
    g_clean, g_dirty = fpol.grad(clean), fpol_garbage_pads.grad(dirty)
    assert torch.isfinite(g_dirty).all()
    assert g_dirty[1, 3].item() == 0.0
    close(g_dirty, g_clean, atol=1e-7)


@pytest.mark.parametrize("loss", registry.LOSSES)
def test_bf16_inputs_are_upcast_and_give_an_fp32_loss(loss):
    pol = make_fpol()
    recipe = resolve_recipe(None, advantage="grpo", loss=loss, reduction="token_mean")
    groups = torch.tensor([0, 0, 1])
    ref, _ = run(recipe, pol, groups)
    logp16 = pol.logp.detach().bfloat16().requires_grad_(True)
    weights = reduction_weights("token_mean", pol.mask)
    out, _ = compute_policy_loss(
        recipe, logp16, pol.old.bfloat16(), pol.rollout.bfloat16(), pol.adv.bfloat16(), pol.mask, weights, groups
    )
    assert out.dtype == torch.float32
    close(out, ref.item(), atol=3e-2)  # bf16 inputs carry ~3 significant digits
    out.backward()
    assert logp16.grad.dtype == torch.bfloat16 and torch.isfinite(logp16.grad.float()).all()


@st.composite
def split_batches(draw):
    groups = draw(st.integers(1, 3))
    size = draw(st.integers(2, 3))
    length = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 100_000))
    gen = torch.Generator().manual_seed(seed)
    batch = groups * size
    mask = torch.rand(batch, length, generator=gen) < 0.8
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length)
    group_ids = torch.arange(groups).repeat_interleave(size)
    cut_groups = sorted(draw(st.lists(st.integers(1, groups), max_size=2, unique=True)))
    return mask, old, logp, rollout, adv, group_ids, [c * size for c in cut_groups]


@settings(max_examples=30, deadline=None)
@given(split_batches(), st.sampled_from(registry.LOSSES), st.sampled_from(registry.REDUCTIONS), st.sampled_from(registry.CORRECTIONS))
def test_micro_batched_policy_loss_equals_the_whole_batch(batch, loss, reduction, correction):
    mask, old, logp, rollout, adv, group_ids, cuts = batch
    recipe = resolve_recipe(None, advantage="grpo", loss=loss, reduction=reduction, correction=correction, l_max=5)
    weights = compute_token_weights(recipe, mask, group_ids, old, rollout).double()

    whole_logp = logp.clone().requires_grad_(True)
    whole, _ = compute_policy_loss(recipe, whole_logp, old, rollout, adv, mask, weights, group_ids)
    (g_whole,) = torch.autograd.grad(whole, whole_logp)

    split_logp = logp.clone().requires_grad_(True)
    bounds = [0, *cuts, mask.shape[0]]
    total = 0.0
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # GVPO needs whole groups per micro-batch: cut at group edges
        if hi > lo:
            part, _ = compute_policy_loss(
                recipe, split_logp[lo:hi], old[lo:hi], rollout[lo:hi], adv[lo:hi], mask[lo:hi], weights[lo:hi], group_ids[lo:hi]
            )
            total = total + part
    (g_split,) = torch.autograd.grad(total, split_logp)
    close(total, whole.item(), atol=1e-10)
    close(g_split, g_whole, atol=1e-10)


TIS_MEAN = (1.051271 + 0.472367 + 1 + 2 + 1.349859 + 0.980199 + 2 + 0.904837 + 1.822119 + 1 + 0.506617) / 11


def test_tis_batch_normalisation_is_a_batch_constant_so_micro_batches_stay_exact(fpol):
    recipe = resolve_recipe("grpo", correction="tis", tis_batch_normalize=True)
    plain = resolve_recipe("grpo", correction="tis")
    normalised, _ = run(recipe, fpol)
    unnormalised, _ = run(plain, make_fpol())
    close(normalised, unnormalised.item() / TIS_MEAN, atol=1e-6)
    weights = compute_token_weights(recipe, fpol.mask, None, fpol.old, fpol.rollout)
    slices = (slice(0, 1), slice(1, 3))
    tis_stats = sum(recipes.tis_normalizer_stats(recipe, fpol.mask[s], fpol.old[s], fpol.rollout[s]) for s in slices)
    close(tis_stats, [TIS_MEAN * 11, 11], atol=1e-5)  # the whole batch: 11 valid tokens, weights to 6 decimals
    parts = [
        compute_policy_loss(
            recipe, fpol.logp[s], fpol.old[s], fpol.rollout[s], fpol.adv[s], fpol.mask[s], weights[s], tis_stats=tis_stats
        )[0]
        for s in slices
    ]
    close(parts[0] + parts[1], normalised.item(), atol=1e-6)


def test_tis_batch_normalisation_rescales_only_the_policy_gradient_term(fpol):
    ref = fpol.old - 0.1
    kl = dict(kl_coef=0.5, kl_estimator="k2")
    normalised, m_norm = run(resolve_recipe("grpo", correction="tis", tis_batch_normalize=True, **kl), fpol, ref=ref)
    plain, m_plain = run(resolve_recipe("grpo", correction="tis", **kl), make_fpol(), ref=ref)
    # k2 = 0.5 (logp - ref)^2 reduced by seq-mean-token-mean: the same with and without normalisation.
    assert m_norm["kl_loss"] == pytest.approx(m_plain["kl_loss"], abs=1e-9)
    close(normalised, m_plain["pg_loss"] / TIS_MEAN + 0.5 * m_plain["kl_loss"], atol=1e-6)
    # The token weights reduce the KL and value terms: they must not carry the 1 / mean(w) factor.
    w_norm, w_plain = (
        compute_token_weights(resolve_recipe("grpo", correction="tis", tis_batch_normalize=flag), fpol.mask, None, fpol.old, fpol.rollout)
        for flag in (True, False)
    )
    assert torch.equal(w_norm, w_plain)
    values, returns = torch.tensor([[1.0, 2.0, 0.5, 0.0]] * 3), torch.zeros(3, 4)
    close(compute_value_loss(values, returns, fpol.mask, w_norm)[0], compute_value_loss(values, returns, fpol.mask, w_plain)[0].item())


@pytest.mark.parametrize("correction", ["tis", "tis_seq"])
def test_micro_batches_with_the_global_tis_normaliser_give_the_whole_batch_loss_and_gradient(correction, fpol):
    recipe = resolve_recipe("grpo", correction=correction, tis_batch_normalize=True, kl_coef=0.1, kl_estimator="k1")
    ref = fpol.old - 0.2
    whole, _ = run(recipe, fpol, ref=ref)
    g_whole = fpol.grad(whole)
    weights = compute_token_weights(recipe, fpol.mask, None, fpol.old, fpol.rollout)
    slices = (slice(0, 1), slice(1, 2), slice(2, 3))
    tis_stats = sum(recipes.tis_normalizer_stats(recipe, fpol.mask[s], fpol.old[s], fpol.rollout[s]) for s in slices)
    split = make_fpol()
    args = (split.logp, split.old, split.rollout, split.adv, split.mask, weights)
    total = sum(compute_policy_loss(recipe, *(a[s] for a in args), None, ref[s], tis_stats)[0] for s in slices)
    close(total, whole.item(), atol=1e-6)
    close(split.grad(total), g_whole, atol=1e-6)
    with pytest.raises(ValueError, match="tis_batch_normalize needs tis_stats"):
        compute_policy_loss(recipe, *args, None, ref)


def test_value_loss_entry_point_reduces_with_token_weights():
    values = torch.tensor([[1.0, 2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, metrics = compute_value_loss(values, torch.tensor([[0.0, 2.5, 0.0]]), mask, reduction_weights("token_mean", mask))
    close(loss, (0.5 + 0.125) / 2)
    assert metrics["value_loss"] == pytest.approx(0.3125)
    loss.backward()
    close(values.grad, [[0.5, -0.25, 0.0]])
