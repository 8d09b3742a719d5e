"""The shared-memory weight sync on real Ray, a real FSDP2 (gloo) learner rank and a real vLLM CPU engine
(tiny model), all shared by the module: parity after a zero-copy sync, versions, a second sync, a joining
worker, the object-store transport on the same pools, and no segment left in /dev/shm after shutdown. The
engine loads in place (`rollout.weight_load: auto` on this narrow model); test_rollout_engine.py covers vLLM's reload."""

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
    """(learner, rollout, shared-memory sync)."""
    from asyncrl.weight_sync.shared_memory import SharedMemorySync

    config = WeightSyncConfig(transport="shared_memory", timeout_s=60.0)
    with wired_pools(tiny_model_dir, lambda learner, rollout: SharedMemorySync(learner, rollout, config, "streaming")) as pools:
        yield pools


def test_after_a_zero_copy_sync_the_engine_scores_as_the_learner(pools):
    import ray

    rollout, shm_sync = pools[1], pools[2]
    # weight_load: auto loads this narrow model (hidden 64) in place: one copy into the parameters.
    assert {ray.get(rollout.handle(n).ready.remote())["weight_load"] for n in rollout.names} == {"in_place"}
    before, after = step_and_sync(pools, shm_sync, version=1, seed=1)
    print(f"parity before {before:.2e}, after {after:.2e}")
    assert before > 1e-3  # the learner really moved (lr 1e-2)
    assert after <= PARITY_ATOL
    published = shm_sync.latest()
    assert published.num_buckets == 1 and published.num_tensors == 51  # 50 parameters + the tied lm_head


def test_a_second_sync_with_changed_weights_is_seen_from_the_other_slot(pools):
    import ray

    shm_sync = pools[2]
    before, after = step_and_sync(pools, shm_sync, version=2, seed=2)
    assert before > 1e-3 and after <= PARITY_ATOL
    assert ray.get(shm_sync.latest().refs[0]).path == f"{shm_sync.root}-0"  # version 1 is in slot 1


def test_a_worker_started_later_loads_the_latest_segment(pools):
    rollout = pools[1]
    name = rollout.add_worker(wait=True)
    try:
        assert rollout.versions()[name] == 2
        assert parity(pools, worker=name) <= PARITY_ATOL
    finally:
        rollout.remove_worker(name)


def test_the_object_store_transport_still_works_on_the_same_engines(pools):
    from asyncrl.weight_sync.object_store import ObjectStoreSync

    learner, rollout, _ = pools
    sync = ObjectStoreSync(learner, rollout, WeightSyncConfig(transport="object_store", timeout_s=60.0), "streaming")
    before, after = step_and_sync(pools, sync, version=3, seed=3)
    assert before > 1e-3 and after <= PARITY_ATOL


def test_shutdown_leaves_no_segment_in_dev_shm(pools):
    shm_sync = pools[2]
    step_and_sync(pools, shm_sync, version=4, seed=4)
    prefix = os.path.basename(shm_sync.root)
    assert sorted(p for p in os.listdir("/dev/shm") if p.startswith(prefix)) == [f"{prefix}-0", f"{prefix}-1"]
    shm_sync.shutdown()  # the driver's side: it also runs when the driver exits, a killed driver's are swept
    assert [p for p in os.listdir("/dev/shm") if p.startswith(prefix)] == []


def test_a_megatron_tp2_learner_publishes_to_the_same_engine_and_exports_hf(pools, tiny_model_dir, tmp_path):
    """The megatron backend, the policy split over two tensor-parallel ranks (gloo), on this module's engine: the
    weights it gathers from both ranks reach the engine exactly through the shared-memory, object-store and collective
    syncs, and its Hugging Face export loads in transformers and scores as the learner does."""
    import numpy as np
    import torch

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.policy import PolicyModel, load_causal_lm
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.weight_sync.collective import CollectiveSync
    from asyncrl.weight_sync.object_store import ObjectStoreSync
    from asyncrl.weight_sync.shared_memory import SharedMemorySync
    from tests.integration.weight_sync_checks import PROBE, PROMPT_LEN

    rollout = pools[1]
    config = LearnerConfig(num_ranks=2, training_backend="megatron", tensor_parallel=2, lr=1e-2)
    learner = LearnerPool(tiny_model_dir, config, resolve_recipe("grpo"))
    shm = SharedMemorySync(learner, rollout, WeightSyncConfig(transport="shared_memory", timeout_s=60.0), "streaming")
    store = ObjectStoreSync(learner, rollout, WeightSyncConfig(transport="object_store", timeout_s=60.0), "streaming")
    collective_config = WeightSyncConfig(transport="collective", bucket_bytes=1 << 16, timeout_s=60.0)
    collective = CollectiveSync(learner, rollout, collective_config, "streaming", loopback=True)
    try:
        for version, sync in ((5, shm), (6, store), (7, collective)):
            before, after = step_and_sync((learner, rollout, sync), sync, version=version, seed=version)
            assert before > 1e-3 and after <= PARITY_ATOL, (version, before, after)
        learner.export_hf(tmp_path / "hf")
        ids = torch.tensor([PROBE])
        with torch.no_grad():
            ours = PolicyModel(load_causal_lm(str(tmp_path / "hf")))(ids, torch.ones_like(ids), torch.arange(len(PROBE))[None], RAW)
        expected = learner.score(PROBE, PROMPT_LEN, RAW)
        assert np.abs(ours[0, PROMPT_LEN - 1 : -1].numpy() - expected).max() < 1e-6
    finally:
        for sync in (shm, store, collective):
            sync.shutdown()
        learner.shutdown()


def test_delta_sync_on_the_same_engine_is_exact_and_resyncs_an_engine_that_missed_a_version(pools):
    """`weight_sync.delta` through the object store, on this module's engine (in-place loads of the changed
    tensors only): parity after a full first sync and a delta; bit-identical scores after the delta and after the
    full version of it; a version without a learner step sends the header alone; a delta the engine cannot
    apply (rank 0 exported a version the engine never got; the engine loaded weights another way) falls back to the
    full version."""
    import numpy as np

    from asyncrl.weight_sync.delta import DeltaSync
    from asyncrl.weight_sync.object_store import ObjectStoreSync
    from tests.integration.weight_sync_checks import PROBE, PROMPT_LEN

    learner, rollout, _ = pools
    sync = DeltaSync(learner, rollout, WeightSyncConfig(delta=True, transport="object_store", timeout_s=60.0), "streaming")
    for version in (8, 9):  # 8: full (the first); 9: a delta
        before, after = step_and_sync(pools, sync, version=version, seed=version)
        assert before > 1e-3 and after <= PARITY_ATOL, (version, before, after)
    after_delta = np.asarray(rollout.score(PROBE, PROMPT_LEN))
    rollout.update_weights(sync.latest().refs, 9)  # the full version 9, as a joining engine gets it
    assert np.array_equal(np.asarray(rollout.score(PROBE, PROMPT_LEN)), after_delta)
    unchanged = sync.finish(sync.start(10))  # no learner step since 9
    assert (unchanged.num_tensors, sync.resyncs) == (1, 0)  # the header alone
    learner.export_delta(11, 1 << 20)  # rank 0 moves on, the engine never sees 11
    before, after = step_and_sync(pools, sync, version=12, seed=12)
    assert sync.resyncs == 1 and before > 1e-3 and after <= PARITY_ATOL
    other = ObjectStoreSync(learner, rollout, WeightSyncConfig(transport="object_store", timeout_s=60.0), "streaming")
    step_and_sync(pools, other, version=13, seed=13)  # weights that came another way: the engine forgets its copy
    before, after = step_and_sync(pools, sync, version=14, seed=14)
    assert sync.resyncs == 2 and before > 1e-3 and after <= PARITY_ATOL


def test_two_fsdp_ranks_write_their_own_rows_into_the_segment_after_the_first_export(pools, tiny_model_dir):
    """A 2-rank FSDP2 learner on this module's engine: the first export gathers on rank 0 (it fixes the layout),
    later ones have each rank write its dim-0 shard into the slot, no gather; parity holds after each."""
    import ray

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.weight_sync.shared_memory import SharedMemorySync

    rollout = pools[1]
    learner = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=2, lr=1e-2, tokens_per_microbatch=4096), resolve_recipe("grpo"))
    sync = SharedMemorySync(learner, rollout, WeightSyncConfig(transport="shared_memory", timeout_s=60.0), "streaming")
    try:
        for version in (15, 16, 17):
            before, after = step_and_sync((learner, rollout, sync), sync, version=version, seed=version)
            assert before > 1e-3 and after <= PARITY_ATOL, (version, before, after)
        assert ray.get([w.__ray_call__.remote(lambda self: self._rows_ready) for w in learner.workers]) == [True, True]
    finally:
        sync.shutdown()
        learner.shutdown()
