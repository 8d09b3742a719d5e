"""The algorithm's section (`algorithm`): a preset and overrides, checked against `asyncrl.algo.registry`."""

from __future__ import annotations

from pydantic import Field, model_validator

from asyncrl.algo import registry
from asyncrl.config.base import Section


class AlgorithmConfig(Section):
    preset: str | None = "cispo"
    """A named recipe (grpo, dr_grpo, dapo, gspo, sapo, cispo, scalerl, dppo, gvpo, maxrl, rloo, reinforce_pp,
    ppo_gae, vapo, sao)."""
    advantage: str | None = None
    """Override the preset's advantage estimator."""
    loss: str | None = None
    """Override the preset's surrogate."""
    reduction: str | None = None
    """Override the preset's loss reduction."""
    correction: str | None = None
    """Override the preset's train-vs-rollout mismatch correction."""
    params: dict[str, float | int | bool | str | None] = Field(default_factory=dict)
    """Parameters of the recipe (e.g. eps_low, eps_high, tis_cap). A name that none of the chosen
    components takes, a wrong type or range, and eps_low/eps_high with CISPO's cap on are rejected
    (`asyncrl.algo.registry` lists what each component takes)."""

    @model_validator(mode="after")
    def _known_names_and_params(self) -> AlgorithmConfig:
        registry.check_choice(self.preset, self._overrides(), self.params)
        return self

    def _overrides(self) -> dict[str, str | None]:
        return {
            "advantage": self.advantage,
            "loss": self.loss,
            "reduction": self.reduction,
            "correction": self.correction,
        }

    def resolved_names(self) -> dict[str, str]:
        """The components the run uses: the preset's, with the ones set here on top."""
        return registry.resolve_components(self.preset, self._overrides())
