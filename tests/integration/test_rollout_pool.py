"""The rollout pool on real Ray with real vLLM CPU engines (tiny model): serving a queue, reward failures,
scaling up and down with requests in flight, a weight sync to a dead worker, health-check replacement.

Tests run in file order on one module-scoped pool; at most two engines are alive at a time. The replay queue
is the rollout unit tests' fake as an actor, with the real queue's API and conservation accounting (each
(group, sample) must be handed in exactly once, by the worker that holds it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tests.unit.rollout.fakes import FakeQueue

pytestmark = pytest.mark.integration

PARITY_ATOL = 1e-5
MAX_TOKENS = 96

# Ray workers import this module by name (the reward `test_rollout_pool:crashing_reward` is a user-style
# `module:function` path) and the fake queue's module `tests.unit.rollout.fakes` (its class is pickled by
# reference): put this folder and the repository root on their path. Workers inherit the environment of
# the Ray cluster the `ray_cluster` fixture starts after collection.
_WORKER_PATH = (str(Path(__file__).parent), str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in _WORKER_PATH if p)


def crashing_reward(response, ground_truth, *, finish_reason, extra_info):
    """The pool's reward in this module: raises for ground truth 'boom'."""
    if ground_truth == "boom":
        raise ValueError("verifier crashed on purpose")
    return float(len(response) > 0)


def _requests(tag: str, n: int, ground_truths=None, group_size: int = 1):
    """`n` prompts of `group_size` samples each (sample-major within a group, as the queue hands them out)."""
    from asyncrl.testing import make_prompt, make_request

    ground_truths = ground_truths or ["12"] * n
    prompts = [make_prompt(f"{tag}{i}", [1, 4 + i % 10, 14, 5, 15], ground_truths[i]) for i in range(n)]
    return [make_request(p, sample_index=k, group_size=group_size) for p in prompts for k in range(group_size)]


def _wait_for(queue, condition, timeout_s: float, what: str) -> dict:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = ray.get(queue.snapshot.remote())
        if condition(snap):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {snap}")


@pytest.fixture(scope="module")
def queue(ray_cluster):
    return ray_cluster.remote(FakeQueue).remote()


class LatestWeights:
    """The weight sync's `latest()` for this module: the weights a test published last (or None)."""

    def __init__(self) -> None:
        self.weights = None

    def __call__(self):
        return self.weights

    def publish(self, pool, buckets, version: int, timeout_s: float) -> None:
        """Publish as a weight sync does: record the weights as the latest, then update every engine."""
        from asyncrl.weights.buckets import unpack_bucket
        from asyncrl.weights.published import PublishedWeights

        num_tensors = sum(len(unpack_bucket(b)) for b in buckets)
        self.weights = PublishedWeights(version, list(buckets), sum(len(b) for b in buckets), num_tensors)
        pool.update_weights(buckets, version=version, in_flight=True, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def latest():
    return LatestWeights()


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_model_dir, queue, latest):
    from asyncrl.config import EnvConfig, RolloutConfig
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.rollout.pool import RolloutPool

    rollout = RolloutConfig(
        num_workers=1, max_tokens=MAX_TOKENS, max_requests_in_flight=8, kv_cache_gib=1.0, engine_start_timeout_s=300
    )
    pool = RolloutPool(
        str(tiny_model_dir),
        rollout,
        EnvConfig(reward=f"{Path(__file__).stem}:crashing_reward", reward_timeout_s=10),
        queue,
        max_model_len=256,
        sampling=SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, timeout_s=120),
        latest=latest,
    )
    pool.start()
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def published(hf_model):
    """Weights the test publishes as version 1 (the model perturbed), and the model they came from."""
    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return pack_buckets(hf_named_tensors(hf_model), bucket_bytes=1 << 18)


def _reference(model, token_ids, prompt_len) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[prompt_len:])[:, None])[:, 0].numpy()


def test_the_pool_serves_the_queue_and_a_crashing_reward_fails_only_its_trajectory(pool, queue):
    import ray

    assert pool.names == ["rollout-0"]
    # Two groups of 4 fill the worker's 8 slots in one hand-out; then 4 single samples, the last one crashing.
    ray.get(queue.add.remote(_requests("g", 2, group_size=4) + _requests("a", 4, ["12"] * 3 + ["boom"])))
    pool.start_generation()
    _wait_for(queue, lambda s: s["finished"] == 12, 120, "12 trajectories")
    finished = [t for t, _ in ray.get(queue.take_finished.remote())]
    failed = [t for t in finished if t.failed]
    assert [t.ground_truth for t in failed] == ["boom"]
    assert failed[0].failure == "reward_error: ValueError: verifier crashed on purpose"
    assert all(t.reward == 1.0 for t in finished if not t.failed)  # the worker kept serving and scoring
    for t in finished:
        assert t.worker == "rollout-0" and len(t.response_ids) == MAX_TOKENS
        assert t.versions.tolist() == [0] * MAX_TOKENS and np.all(t.rollout_logprobs <= 0)
    stats = pool.stats()["rollout-0"]
    assert stats["requests_done"] == 12 and stats["tokens_generated"] == 12 * MAX_TOKENS
    assert stats["vllm_requests"] == 2 + 4  # each group's 4 samples went to vLLM as one request (n = 4)
    assert stats["reward_failures"] == 1 and stats["busy_s"] > 0 and stats["idle_s"] >= 0


def test_an_added_worker_serves_the_latest_published_weights(pool, latest, hf_model, published):
    latest.publish(pool, published, version=1, timeout_s=60)
    assert pool.versions() == {"rollout-0": 1}
    name = pool.add_worker()
    assert name == "rollout-1"
    assert pool.versions() == {"rollout-0": 1, "rollout-1": 1}
    token_ids = [1, 5, 6, 14, 7, 8, 15, 9, 4, 2]
    reference = _reference(hf_model, token_ids, 3)
    for worker in ("rollout-0", "rollout-1"):
        diff = np.abs(pool.score(token_ids, 3, name=worker) - reference).max()
        print(f"{worker} score parity after add_worker: max |diff| = {diff:.2e}")
        assert diff < PARITY_ATOL
    # Greedy evaluation spread over both workers comes back in prompt order.
    prompts = [[1, 4 + i, 14, 5, 15] for i in range(4)]
    results = pool.evaluate(prompts + prompts, max_tokens=5)
    assert len(results) == 8 and results[:4] == results[4:]


def test_removing_a_worker_with_requests_in_flight_re_dispatches_them_and_none_is_lost(pool, queue, latest):
    import ray

    ray.get(queue.add.remote(_requests("b", 24)))
    _wait_for(queue, lambda s: s["in_flight"].get("rollout-0", 0) > 0, 60, "rollout-0 to hold requests")
    # A scale-down while a weight sync is in flight (the controller overlaps syncs with learner steps): the
    # removed engine stops mid-load, the sync completes on the others (the same weights, so versions stay 1).
    loading = pool.start_update(latest().refs, version=1)
    requeued = pool.remove_worker("rollout-0")
    assert requeued > 0
    assert pool.names == ["rollout-1"]
    assert "rollout-0" not in pool.stats() and pool.retired["rollout-0"]["requests_done"] >= 12  # its final counters
    pool.finish_update(loading, version=1, timeout_s=60)
    assert pool.versions() == {"rollout-1": 1}
    snap = _wait_for(queue, lambda s: s["finished"] == 24 and s["pending"] == 0, 180, "all 24 trajectories")
    assert snap["in_flight"] == {} and snap["late"] == 0
    finished = ray.get(queue.take_finished.remote())
    assert sorted(t.group_id for t, _ in finished) == sorted(f"b{i}" for i in range(24))  # each exactly once
    redone = [t for t, attempt in finished if attempt == 1]
    assert len(redone) == requeued and all(t.worker == "rollout-1" for t in redone)
    assert all(t.min_version == 1 for t, _ in finished)


def test_a_weight_sync_to_a_killed_worker_fails_within_its_timeout_naming_it(pool, queue, latest, published):
    import ray

    from asyncrl.rollout.pool import WeightSyncError

    ray.get(queue.add.remote(_requests("c", 6)))
    _wait_for(queue, lambda s: s["in_flight"].get("rollout-1", 0) > 0, 60, "rollout-1 to hold requests")
    assert pool.stats()["rollout-1"]["requests_done"] > 0  # its last report (the re-dispatched "b" requests, at least)
    descendants = _descendants(ray.get(pool.handle("rollout-1").ready.remote())["pid"])
    assert any("EngineCore" in name for name in descendants.values()), descendants  # its engine core (under the engine-core server)
    ray.kill(pool.handle("rollout-1"))
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="rollout-1") as error:
        latest.publish(pool, published, version=2, timeout_s=20)
    print(f"sync to a killed worker failed after {time.monotonic() - started:.2f}s: {error.value}")
    assert time.monotonic() - started < 20 + 5
    _wait_until(lambda: not any(psutil.pid_exists(pid) for pid in descendants), 15, f"the killed worker's processes {descendants}")


def _descendants(pid: int) -> dict[int, str]:
    """Every process under `pid` (its engine core included), by pid, with its name as `ps` shows it."""
    return {p.pid: " ".join(p.cmdline()) or p.name() for p in psutil.Process(pid).children(recursive=True)}


def _poll_until(pool, condition, timeout_s: float, what: str) -> list:
    """The pool's events from its upkeep calls (`poll`, as the controller makes them) until they meet `condition`
    (the first call also returns events earlier tests left queued)."""
    deadline, events = time.monotonic() + timeout_s, []
    while not condition(events):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}; events {events}"
        events += pool.poll()
        time.sleep(0.2)
    return events


def _replacement_joined(events: list) -> bool:
    """A worker died and the replacement started for it joined."""
    replacements = {e.replacement for e in events if e.kind == "died" and e.replacement}
    return any(e.kind == "joined" and e.worker in replacements for e in events)


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def test_upkeep_replaces_a_dead_worker_and_its_requests_are_served(pool, queue):
    import ray

    pool.replace_dead = True  # as `rollout.replace_dead_workers` sets it (the module's pool starts without)
    try:
        events = _poll_until(pool, _replacement_joined, 300, "the dead worker's replacement to join")
    finally:
        pool.replace_dead = False
    dead = [e.worker for e in events if e.kind == "died"]
    assert dead == ["rollout-1"]
    assert pool.names == ["rollout-2"]
    assert set(pool.retired) == {"rollout-0", "rollout-1"} and pool.retired["rollout-1"]["requests_done"] > 0  # kept from its last report
    assert pool.versions() == {"rollout-2": 2}  # the latest published weights, though the failed sync missed it
    snap = _wait_for(queue, lambda s: s["pending"] == 0 and s["in_flight"] == {}, 180, "the re-queued requests")
    assert snap["late"] == 0
    # The "c" batch is served exactly once each: by rollout-1 before it died, or re-dispatched to rollout-2.
    finished = ray.get(queue.take_finished.remote())
    assert sorted(t.group_id for t, _ in finished) == sorted(f"c{i}" for i in range(6))
    assert any(t.worker == "rollout-2" and attempt == 1 for t, attempt in finished)


def test_a_worker_that_does_not_confirm_in_time_fails_the_sync_naming_it(ray_cluster, tiny_model_dir):
    """An engine alive but stuck (no vLLM needed): the sync raises WeightSyncTimeout within its timeout."""
    import asyncio

    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.pool import RolloutPool, WeightSyncTimeout

    @ray_cluster.remote
    class StuckWorker:
        async def update_weights(self, bucket_refs, version, in_flight):
            await asyncio.sleep(60)
            return version

    pool = RolloutPool(str(tiny_model_dir), RolloutConfig())
    pool._workers["rollout-7"] = StuckWorker.remote()
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"rollout-7 did not confirm version 3 within 1.5s"):
        pool.update_weights([b"unused"], version=3, timeout_s=1.5)
    assert time.monotonic() - started < 1.5 + 3
    ray_cluster.kill(pool._workers.pop("rollout-7"))
