"""Parity and version checks shared by the weight-sync integration tests (shared memory, collective).

`pools` is a module fixture's (learner, rollout, sync) tuple: one learner rank, one vLLM engine, tiny model."""

from __future__ import annotations

import numpy as np

from asyncrl.algo.sampling import RAW
from asyncrl.testing import random_groups

PARITY_ATOL = 1e-5
PROBE = [1, 4, 9, 14, 5, 15, 7, 3, 12, 6, 11, 8, 13, 10]  # token ids of the 16-token vocabulary
PROMPT_LEN = 4


def parity(pools, worker: str | None = None) -> float:
    learner, rollout, _ = pools
    engine = np.asarray(rollout.score(PROBE, PROMPT_LEN, name=worker))
    return float(np.max(np.abs(engine - np.asarray(learner.score(PROBE, PROMPT_LEN, RAW)))))


def step_and_sync(pools, sync, version: int, seed: int) -> tuple[float, float]:
    """A learner step that moves the weights, then a sync of `version`: -> (parity before, parity after)."""
    learner, rollout, _ = pools
    learner.train_step(random_groups(seed=seed))
    before = parity(pools)
    result = sync.finish(sync.start(version))
    assert result.version == version and rollout.versions() == {name: version for name in rollout.versions()}
    return before, parity(pools)
