"""The per-component schema of recipe parameters: which component takes what, types, ranges, CISPO's cap."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from asyncrl.algo import registry
from asyncrl.algo import registry as P
from asyncrl.algo.recipes import Recipe, resolve_recipe

SCALERL = {"advantage": "batch_norm", "loss": "cispo", "reduction": "prompt_mean", "correction": "tis"}


def test_params_module_imports_nothing_heavy():
    code = "import sys, asyncrl.algo.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_schema_covers_every_recipe_parameter_and_every_component():
    components = {"advantage", "loss", "reduction", "correction"}
    assert set(P.PARAMS) == {f.name for f in dataclasses.fields(Recipe)} - components
    for table, valid in (
        (P.ADVANTAGE_PARAMS, registry.ADVANTAGES),
        (P.LOSS_PARAMS, registry.LOSSES),
        (P.REDUCTION_PARAMS, registry.REDUCTIONS),
        (P.CORRECTION_PARAMS, registry.CORRECTIONS),
    ):
        assert set(table) == set(valid)
        assert {p for taken in table.values() for p in taken} <= set(P.PARAMS)
    assert set(P.GENERAL_PARAMS) <= set(P.PARAMS)


def test_accepted_params_are_those_of_the_chosen_components_plus_the_general_ones():
    taken = P.accepted_params(SCALERL)
    assert taken[:5] == ("batch_norm_eps", "cispo_eps_max", "eps_low", "eps_high", "tis_cap")
    assert "dual_clip_c" not in taken and "l_max" not in taken and "kl_coef" in taken
    # bypass adds min(q, tis_cap) to the plain policy gradient only.
    bypass = dict(SCALERL, correction="bypass")
    assert "tis_cap" not in P.accepted_params(bypass)
    assert "tis_cap" in P.accepted_params(dict(bypass, loss="reinforce"))


def test_a_param_no_chosen_component_takes_is_rejected_naming_it_the_components_and_the_valid_ones():
    with pytest.raises(ValueError) as err:
        P.check_params(SCALERL, {"dual_clip_c": 3.0, "tis_cap": 2.0})
    message = str(err.value)
    assert "parameter 'dual_clip_c' is not taken by the chosen advantage 'batch_norm', loss 'cispo'," in message
    assert "reduction 'prompt_mean', correction 'tis'" in message
    assert "valid params: batch_norm_eps, cispo_eps_max, eps_low, eps_high, tis_cap, tis_batch_normalize, kl_coef" in message
    assert message.count("is not taken") == 1  # tis_cap is taken
    with pytest.raises(ValueError, match=r"parameter 'tis_capp' .* \(did you mean 'tis_cap'\?\)"):
        P.check_params(SCALERL, {"tis_capp": 2.0})


@pytest.mark.parametrize(
    "params, message",
    [
        ({"tis_cap": 0}, "tis_cap must be > 0 (got 0)"),
        ({"batch_norm_eps": -1e-4}, "batch_norm_eps must be >= 0 (got -0.0001)"),
        ({"tis_batch_normalize": 1}, "tis_batch_normalize must be bool (got 1)"),
        ({"tis_cap": True}, "tis_cap must be float > 0 (got True)"),
        ({"kl_estimator": "k4"}, "kl_estimator must be one of k1, k2, k3, k3_plus (got 'k4')"),
        ({"kl_coef": None}, "kl_coef may not be null"),
    ],
)
def test_types_and_ranges_are_checked(params, message):
    with pytest.raises(ValueError) as err:
        P.check_params(SCALERL, params)
    assert message in str(err.value)


def test_range_texts():
    assert P.PARAMS["gamma"].range_text() == "in (0, 1]"
    assert P.PARAMS["dual_clip_c"].describe() == "float > 1 or null"
    assert P.PARAMS["l_max"].describe() == "int > 0 or null"
    assert P.PARAMS["baseline"].describe() == "float"
    assert P.PARAMS["l_max"].problem("l_max", 2.5) == "l_max must be int > 0 or null (got 2.5)"


def test_cispo_rejects_eps_low_and_eps_high_while_its_cap_is_on():
    assert Recipe().cispo_eps_max is not None  # the rule assumes the cap is on unless set to null
    with pytest.raises(ValueError, match=r"caps its IS weight at cispo_eps_max .* ignores eps_low and eps_high"):
        P.check_params(SCALERL, {"eps_low": 0.1, "eps_high": 0.3})
    with pytest.raises(ValueError, match="set cispo_eps_max to null"):
        P.check_params(SCALERL, {"eps_high": 0.3, "cispo_eps_max": 4.0})
    P.check_params(SCALERL, {"eps_high": 0.3, "cispo_eps_max": None})
    P.check_params(dict(SCALERL, loss="ppo"), {"eps_high": 0.3})
    with pytest.raises(ValueError, match="ignores eps_high"):
        resolve_recipe("scalerl", eps_high=0.3)
    assert resolve_recipe("scalerl", eps_high=0.3, cispo_eps_max=None).eps_high == 0.3


def test_recipe_values_are_checked_against_the_schema():
    with pytest.raises(ValueError, match=r"invalid recipe: gvpo_beta must be > 0 \(got -1.0\); tis_cap must be > 0 \(got 0.0\)"):
        resolve_recipe("grpo", tis_cap=0.0, gvpo_beta=-1.0)
    with pytest.raises(ValueError, match="need overlong_cache_length <= overlong_max_length"):
        resolve_recipe("dapo", overlong_max_length=100)
