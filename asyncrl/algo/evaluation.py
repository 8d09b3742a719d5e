"""Held-out scores from k sampled completions per prompt: mean@k and the unbiased pass@k estimator.

pass@k (Chen et al. 2021, *Evaluating Large Language Models Trained on Code*, arXiv:2107.03374, eq. 1):
with n samples of which c pass, the probability that at least one of k drawn without replacement passes,

    pass@k = 1 - C(n - c, k) / C(n, k),

computed as the product 1 - prod_{i = n - c + 1}^{n} (1 - k / i) so that no binomial overflows. A sample
passes when its reward is at least 1 (full marks; `exact_match` gives 0 or 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EvalScores", "pass_at_k", "score_samples"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `n` samples of which `c` passed (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0  # every draw of k contains a passing sample
    fail_all = 1.0
    for i in range(n - c + 1, n + 1):
        fail_all *= 1.0 - k / i
    return 1.0 - fail_all


@dataclass(frozen=True)
class EvalScores:
    """Scores of one evaluation over its prompts."""

    mean_at_k: float
    """Mean reward over every sample of every prompt (with one greedy sample: the accuracy)."""
    pass_at: dict[int, float]
    """pass@j for j = 1..k, the mean over prompts of `pass_at_k(k, passed, j)`."""


def score_samples(rewards: Sequence[Sequence[float]]) -> EvalScores:
    """rewards[prompt][sample], the same number k >= 1 of samples for every prompt."""
    k = len(rewards[0]) if rewards else 0
    if not rewards or k == 0 or any(len(r) != k for r in rewards):
        raise ValueError("need at least one prompt and the same number (>= 1) of samples for every prompt")
    passed = [sum(r >= 1.0 for r in prompt) for prompt in rewards]
    mean = sum(sum(prompt) for prompt in rewards) / (len(rewards) * k)
    pass_at = {j: sum(pass_at_k(k, c, j) for c in passed) / len(rewards) for j in range(1, k + 1)}
    return EvalScores(mean_at_k=mean, pass_at=pass_at)
