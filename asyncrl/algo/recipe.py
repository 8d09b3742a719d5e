"""The `Recipe`: a fully resolved algorithm choice (advantage, surrogate, reduction, correction) with every
number it uses, and `resolve_recipe`, which builds one from a preset and overrides. The functions that apply
a recipe are in `recipes`; the names, parameters and checks are `registry`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncrl.algo import registry
from asyncrl.lookup import did_you_mean

__all__ = ["PARAM_NAMES", "TIS_LEVEL", "Recipe", "resolve_recipe"]

# Default clip range of each surrogate when eps_low / eps_high are not given.
_LOSS_EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (0.2, 0.28)}
_PPO_EPS = (0.2, 0.2)

# TIS corrections and the level their truncated weight is taken at.
TIS_LEVEL = {"tis": "token", "tis_seq": "sequence"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A fully resolved algorithm choice. Construct through `resolve_recipe`; fields left None are filled
    with the selected surrogate's defaults and every value is validated on construction."""

    advantage: str = "grpo"
    """Advantage estimator, one of registry.ADVANTAGES."""
    loss: str = "ppo"
    """Policy surrogate, one of registry.LOSSES."""
    reduction: str = "token_mean"
    """Loss reduction, one of registry.REDUCTIONS."""
    correction: str = "none"
    """Train-vs-rollout mismatch correction, one of registry.CORRECTIONS."""

    # --- advantages
    gamma: float = 1.0
    """Discount of GAE / REINFORCE++ returns."""
    lam: float = 0.95
    """GAE lambda (advantage `gae`)."""
    critic_lam: float = 1.0
    """Lambda of the value targets of `vapo` (1 = Monte-Carlo returns)."""
    vapo_alpha: float = 0.05
    """VAPO length-adaptive lambda 1 - 1/(alpha*l), clamped to [0, 1]."""
    whiten_advantages: bool = False
    """Whiten GAE / VAPO advantages over the valid tokens of the batch (verl does for GAE)."""
    baseline: float = 0.0
    """Constant baseline b of the `reinforce` advantage A = R - b."""
    grpo_eps: float = 1e-6
    """Added to the group std in GRPO (verl, slime); TRL uses 1e-4."""
    grpo_unbiased: bool = True
    """Bessel-corrected group std in GRPO (all reference implementations)."""
    batch_norm_eps: float = 1e-4
    """Added to the batch std of `batch_norm` (TRL)."""
    maxrl_divide_by_group_size: bool = False
    """MaxRL scaling: False = (r - r_hat)/r_hat for mean reductions (prime-rl), True = survey's /(N r_hat)."""

    # --- surrogates
    eps_low: float | None = None
    """Lower clip epsilon; None = the surrogate's default (ppo/cispo 0.2, gspo 3e-4)."""
    eps_high: float | None = None
    """Upper clip epsilon; None = the surrogate's default (ppo 0.2, cispo 0.28, gspo 4e-4)."""
    dual_clip_c: float | None = None
    """PPO dual clip constant c > 1 (verl uses 3); None = off."""
    cispo_eps_max: float | None = 5.0
    """CISPO absolute cap w = min(rho, eps_max) (ScaleRL); None = band clip(rho, 1-eps_low, 1+eps_high).
    The cap wins: giving eps_low / eps_high to CISPO without cispo_eps_max = None is rejected."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for A <= 0."""
    dppo_delta_low: float | None = None
    """DPPO divergence threshold for A <= 0; None = 0.15 (TV) / 0.05 (KL)."""
    dppo_delta_high: float | None = None
    """DPPO divergence threshold for A > 0; None = 0.15 (TV) / 0.05 (KL)."""
    dppo_clip_c: float = 20.0
    """DPPO cap C of the IS weight min(q, C) (TRL default)."""
    gvpo_beta: float = 0.1
    """GVPO implicit-reward scale."""
    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference loss term (0 = off, needs ref_logprobs otherwise)."""
    kl_estimator: str = "k3"
    """KL estimator of the loss term: k1, k2, k3, k3_plus."""
    kl_in_reward_coef: float = 0.0
    """beta of the KL-in-reward term (0 = off): each response token's reward gets -beta * k1, k1 = log pi_old -
    log pi_ref (`algo.kl.kl_in_reward`), before the advantages. Critic advantages only (gae, vapo): the learner
    ranks compute them, where the reference's log-probs are."""

    # --- corrections
    tis_cap: float = 2.0
    """C of truncated IS min(w, C) (`tis`, `tis_seq`, bypass with `reinforce`)."""
    tis_batch_normalize: bool = False
    """Divide the TIS weights by their mean over the whole optimizer batch, after truncation (verl). Only
    the policy-gradient term is rescaled, never the KL or value terms; see `tis_normalizer_stats`."""
    mis_upper: float = 2.0
    """Upper bound of the MIS keep interval on kappa (token, sequence product or geometric mean)."""
    mis_lower: float | None = None
    """Lower bound of the MIS keep interval; None = 1 / mis_upper."""
    veto_threshold: float | None = None
    """Reject a whole sequence if any token has kappa below this; None = off."""
    icepop_alpha: float = 0.5
    """IcePop lower bound on kappa."""
    icepop_beta: float = 5.0
    """IcePop upper bound on kappa."""
    dis_eps_low: float = 0.3
    """DIS keeps 1 - eps_low < q < 1 + eps_high."""
    dis_eps_high: float = 5.0
    """DIS upper epsilon."""
    decoupled_cap: float | None = 5.0
    """AReaL decoupled PPO: tokens with kappa above this are masked; None = keep all."""
    opsm_delta: float = 0.5
    """OPSM drops sequences with A < 0 and mean(rollout - learner) > delta."""
    denominator_after_rejection: bool = False
    """Reduction denominators count tokens after the rejection mask (verl) instead of before (AReaL, slime)."""

    # --- reduction
    l_max: int | None = None
    """Fixed max response length for `seq_mean_token_sum_norm` (Dr. GRPO); not the padded width."""

    # --- reward shaping (before the advantages, see `shape_rewards`)
    overlong_max_length: int | None = None
    """DAPO soft overlong punishment L_max: responses longer than L_max - overlong_cache_length tokens lose
    reward linearly, down to -overlong_penalty_factor at L_max and beyond; None = off."""
    overlong_cache_length: int = 4096
    """DAPO L_cache: the length of the penalty ramp below overlong_max_length."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty (verl `penalty_factor`)."""

    def __post_init__(self) -> None:
        for kind in (*registry.KINDS, "kl_estimator"):
            registry.check_component(kind, getattr(self, kind))
        default_low, default_high = _LOSS_EPS.get(self.loss, _PPO_EPS)
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", default_low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", default_high)
        problems = registry.value_problems({name: getattr(self, name) for name in registry.PARAMS})
        if self.reduction == "seq_mean_token_sum_norm" and self.l_max is None:
            problems.append("reduction 'seq_mean_token_sum_norm' needs l_max > 0 (the fixed max response length)")
        if not self.icepop_alpha < self.icepop_beta:
            problems.append(f"need icepop_alpha < icepop_beta (got {self.icepop_alpha}, {self.icepop_beta})")
        if self.overlong_max_length is not None and self.overlong_cache_length > self.overlong_max_length:
            problems.append(
                "need overlong_cache_length <= overlong_max_length "
                f"(got {self.overlong_cache_length}, {self.overlong_max_length})"
            )
        if self.kl_in_reward_coef > 0 and self.advantage not in ("gae", "vapo"):
            problems.append(
                f"kl_in_reward_coef > 0 needs a critic advantage (gae, vapo), not {self.advantage!r}: the KL-in-reward "
                "term is folded into the token rewards on the learner ranks, where the critic advantages are computed"
            )
        if self.denominator_after_rejection and self.correction in ("dis", "opsm"):
            problems.append(
                f"correction {self.correction!r} depends on the current policy, so its rejections cannot shrink "
                "the reduction denominator: set denominator_after_rejection = false"
            )
        if problems:
            raise ValueError("invalid recipe: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def needs_reference(self) -> bool:
        """True when the learner needs the frozen reference policy's log-probs: a KL loss term or KL in reward."""
        return self.kl_coef > 0 or self.kl_in_reward_coef > 0

    @property
    def normalizes_tis(self) -> bool:
        """True when the loss needs the batch-global `tis_normalizer_stats`."""
        return self.tis_batch_normalize and self.correction in TIS_LEVEL


PARAM_NAMES = tuple(
    f.name for f in dataclasses.fields(Recipe) if f.name not in ("advantage", "loss", "reduction", "correction")
)


def resolve_recipe(
    preset: str | None = None,
    advantage: str | None = None,
    loss: str | None = None,
    reduction: str | None = None,
    correction: str | None = None,
    **params: Any,
) -> Recipe:
    """Build a Recipe from a preset and overrides. Raises ValueError naming any unknown preset, component
    or parameter together with the valid names (and the closest one), and for eps_low / eps_high given to
    CISPO while its cap is on (`registry.cispo_band_conflict`). Parameters that the chosen components do
    not read are accepted here (tests share parameter sets across components); `asyncrl.config` rejects
    them in a run's config with `registry.check_choice`."""
    unknown = sorted(set(params) - set(PARAM_NAMES))
    if unknown:
        hints = "".join(did_you_mean(name, PARAM_NAMES) for name in unknown)
        raise ValueError(f"unknown recipe parameter(s) {', '.join(unknown)}{hints}; valid: {', '.join(PARAM_NAMES)}")
    fields: dict[str, Any] = {}
    if preset is not None:
        registry.check_component("preset", preset)
        fields.update(registry.PRESET_COMPONENTS[preset])
        fields.update(registry.PRESET_PARAMS.get(preset, {}))
    overrides = {"advantage": advantage, "loss": loss, "reduction": reduction, "correction": correction}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    conflict = registry.cispo_band_conflict(fields.get("loss", Recipe.loss), params)
    if conflict:
        raise ValueError(conflict)
    fields.update(params)
    return Recipe(**fields)
