"""Train-vs-rollout mismatch metrics (docs/algorithms.md#mismatch-metrics), as plain Python floats.

References: verl `compute_offpolicy_metrics` / `compute_is_metrics`, slime
`train_rollout_logprob_abs_diff`, prime-rl `mismatch_kl`; IS diagnostics as in Yao et al. 2025,
https://fengyao.notion.site/off-policy-rl. Formulas: docs/algorithms.md#mismatch-metrics.

All means are masked means over valid tokens (or over non-empty sequences for per-sequence metrics).
kappa = exp(old_logprobs - rollout_logprobs); IS statistics are taken BEFORE truncation. When
`learner_logprobs` is given, the same tail statistics are reported for q = exp(learner - rollout) (DIS).
The whole dict is moved to the host with one `.tolist()` to avoid a device sync per metric.
"""

from __future__ import annotations

import torch

from asyncrl.algo._masked import as_mask, log_ratio, masked_mean, seq_lengths, valid

__all__ = ["lag_mismatch_figures", "lag_mismatch_parts", "mismatch_metrics", "masked_quantiles"]

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


def masked_quantiles(x: torch.Tensor, mask: torch.Tensor, quantiles=QUANTILES) -> torch.Tensor:
    """Quantiles (linear interpolation) of the valid entries of x. Uses sort rather than torch.quantile,
    which refuses inputs above 2^24 elements. Returns [len(quantiles)] (zeros if nothing is valid)."""
    values = x[as_mask(mask)].float().sort().values
    n = values.numel()
    if n == 0:
        return torch.zeros(len(quantiles), device=x.device)
    pos = torch.tensor(quantiles, device=x.device, dtype=torch.float32) * (n - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = pos - lo.float()
    return values[lo] + (values[hi] - values[lo]) * frac


def _ratio_stats(prefix: str, lr: torch.Tensor, mask: torch.Tensor, cap: float) -> dict[str, torch.Tensor]:
    w = torch.exp(lr)
    valid_w = w[mask]
    count = mask.sum().clamp(min=1).float()
    sum_w = valid_w.sum()
    stats = {
        f"{prefix}_is_weight_mean": sum_w / count,
        f"{prefix}_is_weight_max": valid_w.max() if valid_w.numel() else torch.zeros((), device=w.device),
        f"{prefix}_is_weight_min": valid_w.min() if valid_w.numel() else torch.zeros((), device=w.device),
        f"{prefix}_clipped_fraction": masked_mean((w > cap).float(), mask),
        # Normalised effective sample size in (0, 1]: 1 when all weights are equal.
        f"{prefix}_ess": sum_w**2 / ((valid_w**2).sum() * count).clamp(min=1e-30),
    }
    for q, value in zip(QUANTILES, masked_quantiles(w, mask), strict=True):
        stats[f"{prefix}_is_weight_p{round(q * 100):02d}"] = value
    return stats


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_cap: float = 2.0,
    learner_logprobs: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every mismatch metric of docs/algorithms.md#mismatch-metrics. Inputs [B, T] log-probs and mask.
    Returns {name: float}.

    Keys: kl (k1 of KL(mu||pi_train) = mean(rollout - old)), k3_kl, logprob_abs_diff_mean/max,
    training_ppl, rollout_ppl, ppl_ratio, chi2_token, chi2_seq, and for kappa (and q if
    `learner_logprobs` is given): is_weight_mean/max/min, clipped_fraction (> is_cap), ess and quantiles.
    """
    mask = as_mask(mask)
    old = valid(old_logprobs, mask).detach()
    rollout = valid(rollout_logprobs, mask).detach()
    log_kappa = log_ratio(old, rollout, mask)
    kappa = torch.exp(log_kappa)
    nonempty = mask.any(-1)
    lengths = seq_lengths(mask).clamp(min=1)
    mean_old = old.sum(-1) / lengths
    mean_rollout = rollout.sum(-1) / lengths
    seq_log_kappa = log_kappa.sum(-1).clamp(-20.0, 20.0)
    diff = (old - rollout).abs()
    out = {
        "kl": masked_mean(rollout - old, mask),
        "k3_kl": masked_mean(kappa - log_kappa - 1.0, mask),
        "logprob_abs_diff_mean": masked_mean(diff, mask),
        "logprob_abs_diff_max": torch.where(mask, diff, 0.0).max(),
        "training_ppl": masked_mean(torch.exp(-mean_old), nonempty),
        "rollout_ppl": masked_mean(torch.exp(-mean_rollout), nonempty),
        "ppl_ratio": masked_mean(torch.exp(mean_rollout - mean_old), nonempty),
        "chi2_token": masked_mean(kappa**2, mask) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * seq_log_kappa), nonempty) - 1.0,
    }
    out.update(_ratio_stats("kappa", log_kappa, mask, is_cap))
    if learner_logprobs is not None:
        log_q = log_ratio(learner_logprobs.detach(), rollout, mask)
        out.update(_ratio_stats("q", log_q, mask, is_cap))
    names = list(out)
    values = torch.stack([out[k].float().reshape(()) for k in names]).tolist()
    return dict(zip(names, values, strict=True))


LAG_PARTS = "lagpart/"
"""Prefix of the per-lag pieces a rank reports (`lag_mismatch_parts`); `lag_mismatch_figures` consumes them."""


def lag_mismatch_parts(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    lags: torch.Tensor,
    is_cap: float = 2.0,
    keep: torch.Tensor | None = None,
) -> dict[str, float]:
    """The mismatch of each staleness bucket (what a user reads to choose eta), as pieces that merge exactly.

    Inputs [B, T] log-probs and mask, `lags` [B] (each row's policy lag). Keys `lagpart/<lag>/<piece>`: token
    sums ending in `_sum` (`learner.merge.merge_metrics` adds them over ranks), `abs_diff_max` (max) and the
    kappa quantiles `is_weight_pXX` (a token-weighted mean over ranks: exact on one rank, like the batch ones).
    `keep` [B, T]: the tokens the correction keeps (`algo.recipes.correction_keep`), for the masked fraction."""
    mask = as_mask(mask)
    old = valid(old_logprobs, mask).detach()
    rollout = valid(rollout_logprobs, mask).detach()
    log_kappa = log_ratio(old, rollout, mask)
    kappa = torch.exp(log_kappa)
    diff = (old - rollout).abs()
    pieces = {
        "tokens": torch.ones_like(kappa),
        "k1": rollout - old,
        "k3": kappa - log_kappa - 1.0,
        "abs_diff": diff,
        "w": kappa,
        "w2": kappa**2,
        "clipped": (kappa > is_cap).float(),
    }
    if keep is not None:
        pieces["masked"] = (~keep.bool()).float()
    out: dict[str, torch.Tensor] = {}
    for lag in sorted(set(lags.tolist())):
        rows = mask & (lags == lag).to(mask.device)[:, None]
        if not rows.any():
            continue
        key = f"{LAG_PARTS}{lag}/"
        out.update({f"{key}{name}_sum": torch.where(rows, x, 0.0).sum() for name, x in pieces.items()})
        out[f"{key}abs_diff_max"] = torch.where(rows, diff, 0.0).max()
        for q, value in zip(QUANTILES, masked_quantiles(kappa, rows), strict=True):
            out[f"{key}is_weight_p{round(q * 100):02d}"] = value
    names = list(out)
    values = torch.stack([out[k].double().reshape(()) for k in names]).tolist() if names else []
    return dict(zip(names, values, strict=True))


def lag_mismatch_figures(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` with its merged `lagpart/` pieces replaced by `mismatch_<figure>/lag=<lag>`: the same figures
    as `mismatch_metrics` (kl = k1, k3_kl, logprob_abs_diff_mean/max, chi2_token, kappa_ess,
    kappa_clipped_fraction, kappa_is_weight_pXX) plus `tokens`, each a ratio of sums (sum, then divide), and
    `correction_masked_fraction/lag=<lag>` when the parts carry the correction's keep mask."""
    out = {k: v for k, v in metrics.items() if not k.startswith(LAG_PARTS)}
    parts: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith(LAG_PARTS):
            lag, piece = key[len(LAG_PARTS) :].split("/", 1)
            parts.setdefault(lag, {})[piece] = value
    for lag, p in parts.items():
        n = max(p["tokens_sum"], 1e-30)
        figures = {
            "tokens": p["tokens_sum"],
            "kl": p["k1_sum"] / n,
            "k3_kl": p["k3_sum"] / n,
            "logprob_abs_diff_mean": p["abs_diff_sum"] / n,
            "logprob_abs_diff_max": p["abs_diff_max"],
            "chi2_token": p["w2_sum"] / n - 1.0,
            "kappa_ess": p["w_sum"] ** 2 / max(p["w2_sum"] * n, 1e-30),
            "kappa_clipped_fraction": p["clipped_sum"] / n,
            **{f"kappa_{k}": v for k, v in p.items() if k.startswith("is_weight_p")},
        }
        out.update({f"mismatch_{name}/lag={lag}": float(v) for name, v in figures.items()})
        if "masked_sum" in p:
            out[f"correction_masked_fraction/lag={lag}"] = p["masked_sum"] / n
    return out
