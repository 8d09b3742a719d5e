"""The registry of algorithm components: every advantage estimator, loss, reduction, correction and preset
by name, the recipe parameters each reads (with types and ranges), the checks of a choice, and the closest
valid name when one is mistyped.

A parameter that none of the chosen components reads would be silently ignored by the run, so
`asyncrl.config` rejects it (`check_choice`) when the config is loaded, i.e. at `asyncrl check`; `recipes.Recipe`
checks its names and values here too. Defaults and meanings of the parameters are the fields of `recipes.Recipe`,
and the implementations are `recipes`' functions keyed by these names (`recipes` checks at import that both
match this registry). Like the config, this module imports nothing heavy (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.lookup import check_name, did_you_mean

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_PARAMS",
    "COMPONENTS",
    "CORRECTIONS",
    "CORRECTION_PARAMS",
    "GENERAL_PARAMS",
    "KINDS",
    "KL_ESTIMATORS",
    "LOSSES",
    "LOSS_PARAMS",
    "PARAMS",
    "PRESETS",
    "PRESET_COMPONENTS",
    "PRESET_FILTERS",
    "PRESET_PARAMS",
    "REDUCTIONS",
    "REDUCTION_PARAMS",
    "Component",
    "Param",
    "Preset",
    "accepted_params",
    "check_choice",
    "check_component",
    "check_params",
    "cispo_band_conflict",
    "resolve_components",
    "value_problems",
]

Kind = Literal["advantage", "loss", "reduction", "correction"]
KINDS: tuple[Kind, ...] = ("advantage", "loss", "reduction", "correction")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_plus")


# ---------------------------------------------------------------------------------------------------
# Parameters: type and range of each.


@dataclass(frozen=True)
class Param:
    """Type and range of one recipe parameter. Bounds are inclusive unless `*_open`; None = unbounded."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False
    choices: tuple[str, ...] = ()

    def range_text(self) -> str:
        """The allowed values as messages print them: '> 1', '>= 0', 'in (0, 1]', 'one of k1, k2'; '' if any."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return ""

    def describe(self) -> str:
        """'float > 0 or null': the type, the range and whether null is allowed."""
        text = f"{self.kind.__name__} {self.range_text()}".rstrip()
        return text + (" or null" if self.nullable else "")

    def problem(self, name: str, value: Any) -> str | None:
        """Why `value` is not allowed for `name`, or None."""
        if value is None:
            return None if self.nullable else f"{name} may not be null"
        # bool is an int subclass in Python: True must not pass as a number, nor 1 as a flag.
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok_type = {
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            int: is_number and isinstance(value, int),
        }
        if not ok_type.get(self.kind, is_number):
            return f"{name} must be {self.describe()} (got {value!r})"
        out_of_range = (
            (self.choices and value not in self.choices)
            or (self.low is not None and (value < self.low or (self.low_open and value == self.low)))
            or (self.high is not None and (value > self.high or (self.high_open and value == self.high)))
        )
        return f"{name} must be {self.range_text()} (got {value!r})" if out_of_range else None


_POSITIVE = Param(float, 0.0, low_open=True)
_NON_NEGATIVE = Param(float, 0.0)
_UNIT = Param(float, 0.0, 1.0)

PARAMS: dict[str, Param] = {
    # advantages
    "gamma": Param(float, 0.0, 1.0, low_open=True),
    "lam": _UNIT,
    "critic_lam": _UNIT,
    "vapo_alpha": _POSITIVE,
    "whiten_advantages": Param(bool),
    "baseline": Param(float),
    "grpo_eps": _NON_NEGATIVE,
    "grpo_unbiased": Param(bool),
    "batch_norm_eps": _NON_NEGATIVE,
    "maxrl_divide_by_group_size": Param(bool),
    # surrogates
    "eps_low": Param(float, 0.0, nullable=True),
    "eps_high": Param(float, 0.0, nullable=True),
    "dual_clip_c": Param(float, 1.0, low_open=True, nullable=True),
    "cispo_eps_max": Param(float, 0.0, low_open=True, nullable=True),
    "sapo_tau_pos": _POSITIVE,
    "sapo_tau_neg": _POSITIVE,
    "dppo_delta_low": Param(float, 0.0, nullable=True),
    "dppo_delta_high": Param(float, 0.0, nullable=True),
    "dppo_clip_c": _POSITIVE,
    "gvpo_beta": _POSITIVE,
    "kl_coef": _NON_NEGATIVE,
    "kl_estimator": Param(str, choices=KL_ESTIMATORS),
    "kl_in_reward_coef": _NON_NEGATIVE,
    # corrections
    "tis_cap": _POSITIVE,
    "tis_batch_normalize": Param(bool),
    "mis_upper": _POSITIVE,
    "mis_lower": Param(float, 0.0, nullable=True),
    "veto_threshold": Param(float, 0.0, low_open=True, nullable=True),
    "icepop_alpha": _NON_NEGATIVE,
    "icepop_beta": _POSITIVE,
    "dis_eps_low": _UNIT,
    "dis_eps_high": _POSITIVE,
    "decoupled_cap": Param(float, 0.0, low_open=True, nullable=True),
    "opsm_delta": Param(float),
    "denominator_after_rejection": Param(bool),
    # reduction
    "l_max": Param(int, 0, low_open=True, nullable=True),
    # reward shaping
    "overlong_max_length": Param(int, 0, low_open=True, nullable=True),
    "overlong_cache_length": Param(int, 0, low_open=True),
    "overlong_penalty_factor": _NON_NEGATIVE,
}


# ---------------------------------------------------------------------------------------------------
# Components: the parameters each reads.


@dataclass(frozen=True)
class Component:
    """One advantage estimator, loss, reduction or correction: its name and the recipe parameters it reads."""

    kind: Kind
    name: str
    params: tuple[str, ...] = ()
    needs_group: bool = False
    """It compares the samples of one prompt, so `rollout.samples_per_prompt` must be >= 2."""
    needs_critic: bool = False
    """It reads critic values, so `learner.critic` must be on."""


def _by_kind(*components: Component) -> dict[str, dict[str, Component]]:
    table: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
    for c in components:
        table[c.kind][c.name] = c
    return table


_CLIP = ("eps_low", "eps_high")
_DPPO = ("dppo_delta_low", "dppo_delta_high", "dppo_clip_c")
_TIS = ("tis_cap", "tis_batch_normalize")
_MIS = ("mis_upper", "mis_lower")

COMPONENTS: dict[str, dict[str, Component]] = _by_kind(
    Component("advantage", "reinforce", ("baseline",)),
    Component("advantage", "gae", ("gamma", "lam", "whiten_advantages", "kl_in_reward_coef"), needs_critic=True),
    Component(
        "advantage",
        "vapo",
        ("gamma", "vapo_alpha", "critic_lam", "whiten_advantages", "kl_in_reward_coef"),
        needs_critic=True,
    ),
    Component("advantage", "grpo", ("grpo_eps", "grpo_unbiased"), needs_group=True),
    Component("advantage", "dr_grpo", needs_group=True),
    Component("advantage", "rloo", needs_group=True),
    Component("advantage", "reinforce_pp", ("gamma",)),
    Component("advantage", "reinforce_pp_baseline", needs_group=True),
    Component("advantage", "batch_norm", ("batch_norm_eps",), needs_group=True),
    Component("advantage", "maxrl", ("maxrl_divide_by_group_size",), needs_group=True),
    Component("loss", "ppo", (*_CLIP, "dual_clip_c")),
    Component("loss", "cispo", ("cispo_eps_max", *_CLIP)),  # the band eps_low/eps_high only with cispo_eps_max: null
    Component("loss", "gspo", _CLIP),
    Component("loss", "gspo_token", _CLIP),
    Component("loss", "sapo", ("sapo_tau_pos", "sapo_tau_neg")),
    Component("loss", "dppo_tv", _DPPO),
    Component("loss", "dppo_kl", _DPPO),
    Component("loss", "gvpo", ("gvpo_beta",), needs_group=True),
    Component("loss", "reinforce"),
    Component("reduction", "token_mean"),
    Component("reduction", "seq_mean_token_mean"),
    Component("reduction", "seq_mean_token_sum"),
    Component("reduction", "seq_mean_token_sum_norm", ("l_max",)),
    Component("reduction", "prompt_mean"),
    Component("correction", "none"),
    Component("correction", "tis", _TIS),
    Component("correction", "tis_seq", _TIS),
    Component("correction", "mis", _MIS),
    Component("correction", "mis_seq", _MIS),
    Component("correction", "mis_geo", _MIS),
    Component("correction", "icepop", ("icepop_alpha", "icepop_beta")),
    Component("correction", "dis", ("dis_eps_low", "dis_eps_high")),
    Component("correction", "decoupled", ("decoupled_cap",)),
    Component("correction", "bypass"),  # + tis_cap with the reinforce loss, see accepted_params
    Component("correction", "opsm", ("opsm_delta",)),
)
# Taken whatever the components: the KL term, the sequence veto and the denominator convention apply
# to every correction (including none), the reward shaping to every advantage.
GENERAL_PARAMS = (
    "kl_coef",
    "kl_estimator",
    "veto_threshold",
    "denominator_after_rejection",
    "overlong_max_length",
    "overlong_cache_length",
    "overlong_penalty_factor",
)

ADVANTAGES = tuple(COMPONENTS["advantage"])
LOSSES = tuple(COMPONENTS["loss"])
REDUCTIONS = tuple(COMPONENTS["reduction"])
CORRECTIONS = tuple(COMPONENTS["correction"])
ADVANTAGE_PARAMS = {name: c.params for name, c in COMPONENTS["advantage"].items()}
LOSS_PARAMS = {name: c.params for name, c in COMPONENTS["loss"].items()}
REDUCTION_PARAMS = {name: c.params for name, c in COMPONENTS["reduction"].items()}
CORRECTION_PARAMS = {name: c.params for name, c in COMPONENTS["correction"].items()}


# ---------------------------------------------------------------------------------------------------
# Presets: a paper's components, numbers and buffer filters under one name.


@dataclass(frozen=True)
class Preset:
    """A named recipe: its components, the numbers it sets on top of the `Recipe` defaults, and the replay-buffer
    filters its paper uses as `buffer.*` values (`asyncrl.config` makes them the defaults of those fields when
    the preset is chosen; a value the user sets wins)."""

    advantage: str
    loss: str
    reduction: str
    correction: str = "none"
    params: Mapping[str, Any] = field(default_factory=dict)
    filters: Mapping[str, bool] = field(default_factory=dict)

    def components(self) -> dict[str, str]:
        return {
            "advantage": self.advantage,
            "loss": self.loss,
            "reduction": self.reduction,
            "correction": self.correction,
        }


_DAPO_EPS = {"eps_low": 0.2, "eps_high": 0.28}
_ZERO_VARIANCE = {"filter_zero_variance": True}  # DAPO's dynamic sampling

PRESET_TABLE: dict[str, Preset] = {
    "grpo": Preset("grpo", "ppo", "seq_mean_token_mean"),
    "dr_grpo": Preset("dr_grpo", "ppo", "seq_mean_token_sum_norm"),
    "dapo": Preset(
        "grpo",
        "ppo",
        "token_mean",
        params={**_DAPO_EPS, "overlong_max_length": 20480, "overlong_cache_length": 4096},
        filters=_ZERO_VARIANCE,
    ),
    "gspo": Preset("grpo", "gspo", "seq_mean_token_mean"),
    "sapo": Preset("grpo", "sapo", "seq_mean_token_mean"),
    "cispo": Preset("batch_norm", "cispo", "prompt_mean", params={"cispo_eps_max": 5.0}, filters=_ZERO_VARIANCE),
    "scalerl": Preset(  # + no-positive-resampling at 0.9
        "batch_norm",
        "cispo",
        "prompt_mean",
        params={"cispo_eps_max": 5.0},
        filters={**_ZERO_VARIANCE, "pass_rate_curriculum": True},
    ),
    "dppo": Preset("grpo", "dppo_tv", "token_mean"),
    "gvpo": Preset("dr_grpo", "gvpo", "seq_mean_token_sum"),
    "maxrl": Preset("maxrl", "ppo", "seq_mean_token_mean", params={"maxrl_divide_by_group_size": False}),
    "rloo": Preset("rloo", "ppo", "seq_mean_token_mean"),
    "reinforce_pp": Preset("reinforce_pp", "ppo", "token_mean"),
    "ppo_gae": Preset("gae", "ppo", "token_mean", params={"whiten_advantages": True}),
    "vapo": Preset("vapo", "ppo", "token_mean", params=_DAPO_EPS),
    "sao": Preset("vapo", "reinforce", "token_mean", "dis", params={"dis_eps_low": 0.3, "dis_eps_high": 5.0}),
}
PRESETS = tuple(PRESET_TABLE)
PRESET_COMPONENTS = {name: p.components() for name, p in PRESET_TABLE.items()}
PRESET_PARAMS = {name: dict(p.params) for name, p in PRESET_TABLE.items() if p.params}
PRESET_FILTERS = {name: dict(p.filters) for name, p in PRESET_TABLE.items() if p.filters}


# ---------------------------------------------------------------------------------------------------
# Checks of a choice.


def check_component(kind: str, name: str) -> None:
    """Raise ValueError naming an unknown preset, component or KL estimator, the closest and the valid names."""
    other = {"preset": PRESETS, "kl_estimator": KL_ESTIMATORS}
    check_name(kind, name, other[kind] if kind in other else tuple(COMPONENTS[kind]))


def resolve_components(preset: str | None, overrides: Mapping[str, str | None]) -> dict[str, str]:
    """The preset's components with the non-None `overrides` (advantage, loss, reduction, correction) on top;
    correction `none` unless set."""
    chosen = dict(PRESET_COMPONENTS.get(preset or "", {}))
    chosen.update({kind: name for kind, name in overrides.items() if name is not None})
    chosen.setdefault("correction", "none")
    return chosen


def accepted_params(components: Mapping[str, str]) -> tuple[str, ...]:
    """The parameters the chosen components take; `components` maps advantage, loss, reduction and
    correction to their names (as `resolve_components` gives them)."""
    names: list[str] = []
    for kind in KINDS:
        names += COMPONENTS[kind][components[kind]].params
    # bypass weights the plain policy gradient by min(q, tis_cap); ratio losses carry q already.
    if components.get("correction") == "bypass" and components.get("loss") == "reinforce":
        names.append("tis_cap")
    return tuple(dict.fromkeys([*names, *GENERAL_PARAMS]))


def cispo_band_conflict(loss: str, params: Mapping[str, Any]) -> str | None:
    """CISPO either caps its IS weight at cispo_eps_max (on unless set to null: 5.0 by default and in the
    cispo and scalerl presets) or clips it to [1 - eps_low, 1 + eps_high]; never both. Explicit
    eps_low / eps_high with the cap on would be ignored, so they are an error."""
    given = [name for name in ("eps_low", "eps_high") if name in params]
    if loss != "cispo" or not given or ("cispo_eps_max" in params and params["cispo_eps_max"] is None):
        return None
    return (
        f"loss 'cispo' caps its IS weight at cispo_eps_max (not null), which ignores {' and '.join(given)}: "
        "set cispo_eps_max to null to clip to [1 - eps_low, 1 + eps_high] instead, or drop " + " and ".join(given)
    )


def value_problems(params: Mapping[str, Any]) -> list[str]:
    """Type and range problems of the given parameter values (names not in PARAMS are skipped)."""
    problems = (PARAMS[name].problem(name, value) for name, value in params.items() if name in PARAMS)
    return [p for p in problems if p is not None]


def check_params(components: Mapping[str, str], params: Mapping[str, Any]) -> None:
    """Raise ValueError if a parameter is not taken by the chosen components (naming it, the components
    and the parameters they take), has the wrong type or range, or conflicts with CISPO's cap."""
    accepted = accepted_params(components)
    chosen = ", ".join(f"{kind} {components[kind]!r}" for kind in KINDS)
    problems = [
        f"parameter {name!r} is not taken by the chosen {chosen}{did_you_mean(name, accepted)}; "
        f"valid params: {', '.join(accepted)}"
        for name in params
        if name not in accepted
    ]
    problems += value_problems({k: v for k, v in params.items() if k in accepted})
    conflict = cispo_band_conflict(components["loss"], params)
    if conflict:
        problems.append(conflict)
    if problems:
        raise ValueError("; ".join(problems))


def check_choice(preset: str | None, overrides: Mapping[str, str | None], params: Mapping[str, Any]) -> dict[str, str]:
    """The whole check of a config's algorithm: known preset and component names, the three components a run
    without a preset must name, and `check_params`; returns the resolved components."""
    if preset is not None:
        check_component("preset", preset)
    for kind, name in overrides.items():
        if name is not None:
            check_component(kind, name)
    if preset is None and None in (overrides.get("advantage"), overrides.get("loss"), overrides.get("reduction")):
        raise ValueError("without a preset, set advantage, loss and reduction")
    components = resolve_components(preset, overrides)
    check_params(components, params)
    return components
