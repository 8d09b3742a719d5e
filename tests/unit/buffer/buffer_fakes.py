"""Hand-written fakes for the replay-queue tests: a settable clock, a config and prompts (rollout answers
come from `asyncrl.testing.make_answer`)."""

from __future__ import annotations

from asyncrl.config import BufferConfig
from asyncrl.testing import make_prompt
from asyncrl.types import Prompt


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(**overrides) -> BufferConfig:
    """Filters, the ready lead and the Parquet log off unless a test turns them on: η alone bounds the lead."""
    base = dict(filter_zero_variance=False, filter_overlong=False, pass_rate_curriculum=False, log_parquet=False, max_ready_batches=None)
    base.update(overrides)
    return BufferConfig(**base)


def make_prompts(n: int, prefix: str = "p") -> list[Prompt]:
    """`n` prompts with distinct ids and ground truths, so a test can tell their groups apart."""
    return [make_prompt(f"{prefix}{k}", [1, 2, 3 + k % 5], str(k)) for k in range(n)]
