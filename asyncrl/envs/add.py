"""W1 `add`: prompt "<a>+<b>=", answer the decimal sum then end-of-sequence (benchmarks/README.md).

The held-out set is 500 pairs from a fixed seed; training and warm-start pairs never include them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

HELDOUT_SEED = 20_260_101
WARM_START_SEED = 7


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def heldout_pairs(n: int = 500, max_operand: int = 999) -> list[tuple[int, int]]:
    rng = random.Random(HELDOUT_SEED)
    seen: set[tuple[int, int]] = set()
    while len(seen) < n:
        seen.add((rng.randint(0, max_operand), rng.randint(0, max_operand)))
    return sorted(seen, key=lambda p: rng.random())


def train_pairs(
    seed: int, max_operand: int = 999, exclude: set[tuple[int, int]] | None = None
) -> Iterator[tuple[int, int]]:
    """An endless stream of training pairs disjoint from `exclude` (the held-out set)."""
    rng = random.Random(seed)
    exclude = exclude if exclude is not None else set(heldout_pairs(max_operand=max_operand))
    while True:
        pair = (rng.randint(0, max_operand), rng.randint(0, max_operand))
        if pair not in exclude:
            yield pair
