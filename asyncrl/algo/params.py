"""Which recipe parameters each advantage, loss, reduction and correction takes, with their types and ranges.

A parameter that none of the chosen components reads would be silently ignored by the run, so
`asyncrl.config` rejects it (`check_params`) when the config is loaded, i.e. at `asyncrl check`. Defaults
and meanings of the parameters are the fields of `recipes.Recipe`, which also validates its values here
(`value_problems`); a test keeps the names of both in step. Like `names`, this module imports nothing
heavy, so the config stays cheap to import.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.algo.names import KL_ESTIMATORS

__all__ = [
    "ADVANTAGE_PARAMS",
    "CORRECTION_PARAMS",
    "GENERAL_PARAMS",
    "LOSS_PARAMS",
    "PARAMS",
    "REDUCTION_PARAMS",
    "Param",
    "accepted_params",
    "check_params",
    "cispo_band_conflict",
    "value_problems",
]


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

ADVANTAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "reinforce": ("baseline",),
    "gae": ("gamma", "lam", "whiten_advantages"),
    "vapo": ("gamma", "vapo_alpha", "critic_lam", "whiten_advantages"),
    "grpo": ("grpo_eps", "grpo_unbiased"),
    "dr_grpo": (),
    "rloo": (),
    "reinforce_pp": ("gamma",),
    "reinforce_pp_baseline": (),
    "batch_norm": ("batch_norm_eps",),
    "maxrl": ("maxrl_divide_by_group_size",),
}
_CLIP = ("eps_low", "eps_high")
_DPPO = ("dppo_delta_low", "dppo_delta_high", "dppo_clip_c")
LOSS_PARAMS: dict[str, tuple[str, ...]] = {
    "ppo": (*_CLIP, "dual_clip_c"),
    "cispo": ("cispo_eps_max", *_CLIP),  # the band eps_low/eps_high only with cispo_eps_max: null
    "gspo": _CLIP,
    "gspo_token": _CLIP,
    "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    "dppo_tv": _DPPO,
    "dppo_kl": _DPPO,
    "gvpo": ("gvpo_beta",),
    "reinforce": (),
}
REDUCTION_PARAMS: dict[str, tuple[str, ...]] = {
    "token_mean": (),
    "seq_mean_token_mean": (),
    "seq_mean_token_sum": (),
    "seq_mean_token_sum_norm": ("l_max",),
    "prompt_mean": (),
}
_MIS = ("mis_upper", "mis_lower")
CORRECTION_PARAMS: dict[str, tuple[str, ...]] = {
    "none": (),
    "tis": ("tis_cap", "tis_batch_normalize"),
    "tis_seq": ("tis_cap", "tis_batch_normalize"),
    "mis": _MIS,
    "mis_seq": _MIS,
    "mis_geo": _MIS,
    "icepop": ("icepop_alpha", "icepop_beta"),
    "dis": ("dis_eps_low", "dis_eps_high"),
    "decoupled": ("decoupled_cap",),
    "bypass": (),  # + tis_cap with the reinforce loss, see accepted_params
    "opsm": ("opsm_delta",),
}
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
_KINDS = (
    ("advantage", ADVANTAGE_PARAMS),
    ("loss", LOSS_PARAMS),
    ("reduction", REDUCTION_PARAMS),
    ("correction", CORRECTION_PARAMS),
)


def accepted_params(components: Mapping[str, str]) -> tuple[str, ...]:
    """The parameters the chosen components take; `components` maps advantage, loss, reduction and
    correction to their names (as `AlgorithmConfig.resolved_names()` gives them)."""
    names: list[str] = []
    for kind, table in _KINDS:
        names += table[components[kind]]
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
    chosen = ", ".join(f"{kind} {components[kind]!r}" for kind, _ in _KINDS)
    problems = []
    for name in params:
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                f"parameter {name!r} is not taken by the chosen {chosen}{hint}; valid params: {', '.join(accepted)}"
            )
    problems += value_problems({k: v for k, v in params.items() if k in accepted})
    conflict = cispo_band_conflict(components["loss"], params)
    if conflict:
        problems.append(conflict)
    if problems:
        raise ValueError("; ".join(problems))
