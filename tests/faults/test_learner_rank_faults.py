"""A learner rank that dies or hangs (real SIGKILL / SIGSTOP of its process) stops the run within
`learner.call_timeout_s`, with an error that names the rank and the call."""

from __future__ import annotations

import os
import signal
import time

import pytest

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.config import LearnerConfig
from asyncrl.learner.pool import LearnerCallError, LearnerPool
from asyncrl.testing import random_groups as make_groups

pytestmark = pytest.mark.integration


def _pool(tiny_model_dir, call_timeout_s: float) -> tuple[LearnerPool, list[int]]:
    import ray

    pool = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=2, call_timeout_s=call_timeout_s), resolve_recipe("grpo"))
    pool.train_step(make_groups())  # healthy first
    return pool, ray.get([w.pid.remote() for w in pool.workers])


def test_a_killed_rank_fails_the_next_step_naming_it(ray_cluster, tiny_model_dir):
    pool, pids = _pool(tiny_model_dir, call_timeout_s=60)
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(LearnerCallError, match=r"learner rank 1: train_step failed: the rank died"):
        pool.train_step(make_groups())
    assert time.monotonic() - started < 60  # the death is reported, not waited out
    ray_cluster.kill(pool.workers[0])


def test_a_hung_rank_times_out_naming_the_rank_and_the_call(ray_cluster, tiny_model_dir):
    pool, pids = _pool(tiny_model_dir, call_timeout_s=5)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(LearnerCallError, match=r"learner rank 0: train_step did not answer within 5(\.0)?s"):
            pool.train_step(make_groups())
        assert time.monotonic() - started < 5 + 10  # at its own 5 s, with room for a busy machine; not at the default
    finally:
        os.kill(pids[0], signal.SIGKILL)
        ray_cluster.kill(pool.workers[1])


def test_a_rank_that_cannot_set_up_is_named_when_the_pool_is_first_waited_for(ray_cluster, tmp_path):
    # The ranks set up in the background (a run starts its engines meanwhile): the pool is built at once,
    # and the failure surfaces at the first wait, naming the rank and the call.
    pool = LearnerPool(tmp_path / "no-such-model", LearnerConfig(num_ranks=2, call_timeout_s=60), resolve_recipe("grpo"))
    try:
        with pytest.raises(LearnerCallError, match=r"(?s)learner rank [01]: setup failed: .*no-such-model"):
            pool.wait_ready()
    finally:
        pool.shutdown()
