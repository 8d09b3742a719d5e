"""Parity and version checks shared by the weight-sync integration tests (shared memory, collective).

`pools` is a module fixture's (learner, rollout, sync) tuple: one learner rank, one vLLM engine, tiny model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from asyncrl.algo.sampling import RAW
from asyncrl.testing import random_groups

PARITY_ATOL = 1e-5
PROBE = [1, 4, 9, 14, 5, 15, 7, 3, 12, 6, 11, 8, 13, 10]  # token ids of the 16-token vocabulary
PROMPT_LEN = 4


@contextmanager
def wired_pools(model_dir, make_sync: Callable[[Any, Any], Any], lora=None) -> Iterator[tuple[Any, Any, Any]]:
    """(learner, rollout, sync) wired as the controller wires them on a single node: one learner rank, one
    engine, and a joining worker loads what the sync published last. `make_sync(learner, rollout)` builds the
    transport; `lora` (a `LoraConfig`): the learner trains adapters and the engine serves them. Everything is shut
    down on exit."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import EnvConfig, LearnerConfig, RolloutConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool

    learner = LearnerPool(model_dir, LearnerConfig(num_ranks=1, tokens_per_microbatch=4096, lr=1e-2, lora=lora), resolve_recipe("grpo"))
    made: list[Any] = []
    rollout = RolloutPool(str(model_dir), RolloutConfig(num_workers=1), EnvConfig(), queue=None, dtype="float32", max_model_len=64,
                          latest=lambda: made[0].latest(), lora_rank=lora.rank if lora is not None else None)
    made.append(make_sync(learner, rollout))
    try:
        rollout.start()
        yield learner, rollout, made[0]
    finally:
        rollout.shutdown()
        learner.shutdown()
        made[0].shutdown()


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
