"""Mismatch metrics of docs/algorithms.md#mismatch-metrics on F-POL."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.metrics import masked_quantiles, mismatch_metrics

SPEC = {
    "kl": -0.190909,
    "k3_kl": 0.408774,
    "logprob_abs_diff_mean": 0.472727,
    "logprob_abs_diff_max": 1.8,
    "training_ppl": 2.583858,
    "rollout_ppl": 3.325018,
    "ppl_ratio": 0.832388,
    "chi2_token": 3.832236,
    "kappa_clipped_fraction": 0.181818,
}


def test_mismatch_metrics_match_spec_and_are_plain_floats(fpol_garbage_pads):
    pol = fpol_garbage_pads  # NaN / -inf at the pad must not leak into any metric
    metrics = mismatch_metrics(pol.old, pol.rollout, pol.mask, is_cap=2.0, learner_logprobs=pol.logp)
    for name, expected in SPEC.items():
        assert metrics[name] == pytest.approx(expected, abs=2e-6), name
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
    # chi2_seq = mean_i exp(2 sum log kappa) - 1 with seq products [1.221403, 8.004469, 0.835270].
    assert metrics["chi2_seq"] == pytest.approx((1.221403**2 + 8.004469**2 + 0.835270**2) / 3 - 1, abs=1e-4)
    assert metrics["kappa_is_weight_max"] == pytest.approx(6.049647, abs=1e-5)
    assert metrics["kappa_is_weight_min"] == pytest.approx(0.472367, abs=1e-6)
    assert 0 < metrics["kappa_ess"] <= 1
    assert metrics["q_is_weight_max"] == pytest.approx(6.359820, abs=1e-5)


def test_equal_weights_have_full_effective_sample_size():
    logp = torch.zeros(2, 3)
    metrics = mismatch_metrics(logp, logp, torch.ones(2, 3, dtype=torch.bool))
    assert metrics["kappa_ess"] == pytest.approx(1.0)
    assert metrics["kl"] == 0.0 and metrics["chi2_token"] == pytest.approx(0.0)


def test_masked_quantiles_interpolate_over_valid_entries():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    q = masked_quantiles(x, mask, (0.0, 0.5, 1.0))
    assert q.tolist() == [1.0, 3.0, 5.0]
