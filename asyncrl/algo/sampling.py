"""The distribution an engine samples from, recomputed by the learner (architecture invariant 4).

vLLM (checked on 0.32, `apply_top_k_top_p_pytorch` in vllm/v1/sample/ops/topk_topp_sampler.py) processes
the logits of a random-sampling request in this order:

    logits / temperature
    -> top-k: every logit below the k-th largest is set to -inf (ties with the k-th value are kept)
    -> top-p: on the probabilities of what top-k kept, sorted ascending, the tail whose cumulative mass is
       <= 1 - top_p is set to -inf (the most likely token is always kept)
    -> log_softmax over what is left.

With `logprobs_mode="processed_logprobs"` (rollout/vllm_compat/process.py) the rollout log-prob of a sampled token
is its log-prob under that renormalised distribution, so the learner must score the same one:
`processed_logits` reproduces the steps above on the learner's logits.

Tokens outside the kept set: an on-policy sampled token is always inside it, but once the weights moved
(a stale sample, or pi_theta after the first mini-batch update) the learner's own kept set may exclude
it; its learner log-prob is then -inf. `in_support` takes such a token out of the loss (no value, no
gradient; the reduction's denominators still count it, as for a token rejected by a correction) and the
learner reports the fraction as `outside_support_frac`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RAW", "SamplingDistribution", "in_support", "logprob_gap", "processed_logits", "token_logprobs"]


@dataclass(frozen=True)
class SamplingDistribution:
    """How rollout log-probs were produced: temperature, then top-k, then top-p (vLLM semantics)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k."""

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(f"need temperature > 0, 0 < top_p <= 1, top_k >= 0 (got {self})")

    @property
    def truncates(self) -> bool:
        """True when some tokens get probability 0 (top-k or top-p active)."""
        return self.top_p < 1.0 or self.top_k > 0


RAW = SamplingDistribution()
"""The model's own distribution (temperature 1, nothing truncated): what vLLM's prompt log-probs are."""


def processed_logits(logits: torch.Tensor, dist: SamplingDistribution) -> torch.Tensor:
    """[..., V] logits -> fp32 logits of the processed distribution, -inf outside the kept set."""
    logits = logits.float() / dist.temperature
    if not dist.truncates:
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    if 0 < dist.top_k < vocab:
        kth_largest = ascending[..., vocab - dist.top_k : vocab - dist.top_k + 1]
        ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    if dist.top_p < 1.0:
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = tail_mass <= 1 - dist.top_p
        dropped[..., -1] = False
        ascending = ascending.masked_fill(dropped, float("-inf"))
    return torch.empty_like(ascending).scatter(-1, order, ascending)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, dist: SamplingDistribution) -> torch.Tensor:
    """logits [..., V], targets [...] -> log-prob of each target under the processed distribution [...]
    (-inf for a target outside the kept set)."""
    logprobs = torch.log_softmax(processed_logits(logits, dist), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def in_support(mask: torch.Tensor, logprobs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(mask without the tokens any of `logprobs` gives probability 0, each log-prob with those positions
    set to 0). The replacement goes through `torch.where`, so no gradient reaches a -inf entry."""
    finite = torch.stack([torch.isfinite(lp) for lp in logprobs]).all(dim=0)
    kept = mask.bool() & finite
    return kept, [torch.where(finite, lp, torch.zeros_like(lp)) for lp in logprobs]


def logprob_gap(engine: Sequence[float], learner: Sequence[float]) -> float:
    """Max |engine - learner| over positions; a token both sides put outside the kept set (-inf on both)
    agrees, one side only is an infinite gap."""
    engine_t = torch.tensor([float(x) for x in engine], dtype=torch.float64)  # copies: inputs may be read-only arrays
    learner_t = torch.tensor([float(x) for x in learner], dtype=torch.float64)
    both_out = torch.isneginf(engine_t) & torch.isneginf(learner_t)
    gap = torch.where(both_out, 0.0, (engine_t - learner_t).abs())
    return float(gap.max()) if gap.numel() else 0.0
