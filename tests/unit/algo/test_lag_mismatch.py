"""Mismatch split by staleness bucket: hand-checkable figures, and the same figures whatever the rank split."""

import math

import pytest
import torch

from asyncrl.algo.metrics import lag_mismatch_figures, lag_mismatch_parts
from asyncrl.learner.merge import merge_metrics

LOG2 = math.log(2.0)
# Row 0 (lag 0): learner == rollout on 2 tokens. Row 1 (lag 1): kappa = 2 on its first token, 1 on its second.
OLD = torch.tensor([[-1.0, -2.0], [-1.0 + LOG2, -3.0]])
ROLLOUT = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]])
MASK = torch.ones(2, 2, dtype=torch.bool)
LAGS = torch.tensor([0, 1])


def test_each_lag_gets_its_own_hand_checked_figures():
    figures = lag_mismatch_figures(lag_mismatch_parts(OLD, ROLLOUT, MASK, LAGS, is_cap=1.5))
    assert figures["mismatch_k3_kl/lag=0"] == pytest.approx(0.0)
    assert figures["mismatch_kappa_ess/lag=0"] == pytest.approx(1.0)
    assert figures["mismatch_tokens/lag=1"] == 2
    assert figures["mismatch_kl/lag=1"] == pytest.approx(-LOG2 / 2)  # k1 = mean(rollout - old)
    assert figures["mismatch_k3_kl/lag=1"] == pytest.approx((2 - LOG2 - 1) / 2)  # mean(kappa - log kappa - 1)
    assert figures["mismatch_logprob_abs_diff_mean/lag=1"] == pytest.approx(LOG2 / 2)
    assert figures["mismatch_logprob_abs_diff_max/lag=1"] == pytest.approx(LOG2)
    assert figures["mismatch_chi2_token/lag=1"] == pytest.approx((4 + 1) / 2 - 1)  # mean(kappa^2) - 1
    assert figures["mismatch_kappa_ess/lag=1"] == pytest.approx(3**2 / (5 * 2))  # (sum w)^2 / (sum w^2 * n)
    assert figures["mismatch_kappa_clipped_fraction/lag=1"] == pytest.approx(0.5)  # kappa 2 > cap 1.5
    assert figures["mismatch_kappa_is_weight_p50/lag=1"] == pytest.approx(1.5)  # midway between 1 and 2
    assert not any(k.startswith("lagpart/") for k in figures)


def test_masked_tokens_do_not_count_and_other_keys_pass_through():
    mask = torch.tensor([[True, False], [True, True]])
    figures = lag_mismatch_figures({"loss": 3.0, **lag_mismatch_parts(OLD, ROLLOUT, mask, LAGS)})
    assert figures["mismatch_tokens/lag=0"] == 1
    assert figures["loss"] == 3.0


def test_figures_are_the_same_when_rows_are_split_over_ranks_of_unequal_size():
    whole = lag_mismatch_figures(lag_mismatch_parts(OLD, ROLLOUT, MASK, torch.tensor([1, 1])))
    # Rank A holds row 0 (2 loss tokens), rank B row 1: sums add, so the lag-1 mean is over all 4 tokens.
    ranks = [(lag_mismatch_parts(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], torch.tensor([1])), 2.0) for i in range(2)]
    merged = lag_mismatch_figures(merge_metrics(ranks))
    for key in ("tokens", "kl", "k3_kl", "logprob_abs_diff_mean", "logprob_abs_diff_max", "chi2_token", "kappa_ess"):
        assert merged[f"mismatch_{key}/lag=1"] == pytest.approx(whole[f"mismatch_{key}/lag=1"]), key
    assert merged["mismatch_k3_kl/lag=1"] == pytest.approx((2 - LOG2 - 1) / 4)


def test_the_masked_fraction_of_each_lag_comes_from_the_correction_keep_mask():
    from asyncrl.algo.recipes import correction_keep, resolve_recipe

    # MIS with upper bound 1.5 rejects kappa = 2 (row 1, token 0) and keeps kappa = 1 everywhere else.
    recipe = resolve_recipe("grpo", correction="mis", mis_upper=1.5, mis_lower=0.5)
    keep = correction_keep(recipe, OLD, ROLLOUT, MASK)
    assert keep.tolist() == [[True, True], [False, True]]
    figures = lag_mismatch_figures(lag_mismatch_parts(OLD, ROLLOUT, MASK, LAGS, keep=keep))
    assert figures["correction_masked_fraction/lag=0"] == 0.0
    assert figures["correction_masked_fraction/lag=1"] == 0.5  # 1 of its 2 tokens
    assert correction_keep(resolve_recipe("grpo", correction="opsm"), OLD, ROLLOUT, MASK) is None  # needs advantages
