"""The collective weight sync on real Ray, a real FSDP2 (gloo) learner rank and a real vLLM CPU engine (tiny
model), shared by the module: two syncs over the engine's gloo group (64 kB buckets: the 1.2 MB model in ~20),
parity after each, the version the engine reports equal to the learner's, and a worker started later that
pulls `latest()` over a group of its own while the first engine keeps syncing over its group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.config import WeightSyncConfig
from tests.integration.weight_sync_checks import PARITY_ATOL, parity, step_and_sync, wired_pools

pytestmark = pytest.mark.integration

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_model_dir):
    """(learner, rollout, collective sync in 64 kB buckets) on a single node."""
    from asyncrl.weight_sync.collective import CollectiveSync

    config = WeightSyncConfig(transport="collective", bucket_bytes=1 << 16, timeout_s=60.0)
    with wired_pools(tiny_model_dir, lambda learner, rollout: CollectiveSync(learner, rollout, config, "streaming", loopback=True)) as pools:
        yield pools


def test_two_syncs_over_the_engines_group_give_parity_and_the_learners_version(pools):
    import ray

    rollout, sync = pools[1], pools[2]
    for version in (1, 2):
        before, after = step_and_sync(pools, sync, version=version, seed=version)  # asserts every engine reports `version`
        print(f"version {version}: parity before {before:.2e}, after {after:.2e}")
        assert before > 1e-3  # the learner really moved (lr 1e-2)
        assert after <= PARITY_ATOL
        assert [ray.get(rollout.handle(n).version.remote()) for n in rollout.names] == [version]
    published = sync.latest()
    assert ray.get(published.refs[0]).backend == "gloo" and ray.get(published.refs[0]).host == "127.0.0.1"
    assert published.num_buckets == 1 and published.num_tensors == 51  # one record; 50 parameters + the tied lm_head


def test_a_worker_started_later_pulls_the_latest_version_over_its_own_group(pools):
    rollout, sync = pools[1], pools[2]
    name = rollout.add_worker(wait=True)
    try:
        assert rollout.versions()[name] == 2
        assert parity(pools, worker=name) <= PARITY_ATOL
        before, after = step_and_sync(pools, sync, version=3, seed=3)  # both engines, each over its own group
        assert before > 1e-3 and after <= PARITY_ATOL and parity(pools, worker=name) <= PARITY_ATOL
    finally:
        rollout.remove_worker(name)
