"""The replay queue as a real async Ray actor: concurrent producers and a learner, timeouts, conservation."""

import asyncio
import time

import pytest

from asyncrl.buffer import QueueCallTimeout, QueueClient, QueueTimeouts, start_replay_queue
from asyncrl.config import BufferConfig
from asyncrl.testing import make_answer, make_prompt
from asyncrl.types import PackedTrajectories

pytestmark = pytest.mark.integration


def test_concurrent_producers_and_a_learner_conserve_every_sample(ray_cluster):
    num_prompts, group_size, batch_groups, eta = 48, 2, 4, 1
    client = start_replay_queue(BufferConfig(max_staleness=eta, log_parquet=False), batch_groups=batch_groups, name="rq-concurrent")
    client.add_prompts([make_prompt(f"p{k}") for k in range(num_prompts)], group_size)
    queue = client.handle  # producers and the learner below call the actor concurrently, as rollout workers do
    learner = {"version": 0, "done": False}

    async def producer(worker: str, dies_after: int | None = None) -> None:
        calls = 0
        while not learner["done"]:
            requests = await queue.acquire.remote(worker, 3, timeout_s=0.2)
            calls += 1
            if dies_after is not None and calls > dies_after and requests:
                await queue.requeue_worker.remote(worker)  # what the controller does when it sees the actor die
                return
            if not requests:
                continue
            version = learner["version"]  # weights of this engine: the last published version
            answers = [
                # attempt=None: the queue matches these answers by worker only
                make_answer(r, 4, worker=worker, versions=version, reward=float(r.sample_index % 2), attempt=None,
                            failure="timeout" if (k + calls) % 7 == 0 else None)
                for k, r in enumerate(requests)
            ]
            await queue.put.remote(answers)

    async def consumer() -> list:
        lags = []
        for _ in range(200):
            batch = await queue.get_batch.remote(batch_groups, learner["version"], timeout_s=20.0, min_groups=0)
            if not batch.groups:
                stats = await queue.stats.remote()
                if stats["in_flight"] == 0 and stats["backlog_groups"] == 0:
                    break
                continue
            assert batch.version == learner["version"]
            assert batch.lags == [learner["version"] - t.min_version for g in batch.groups for t in g.trajectories]
            lags += batch.lags
            learner["version"] += 1
            await queue.set_version.remote(learner["version"])
        learner["done"] = True
        return lags

    async def run() -> list:
        results = await asyncio.gather(
            consumer(), producer("w0"), producer("w1"), producer("w2"), producer("w-dies", dies_after=2)
        )
        return results[0]

    start = time.monotonic()
    lags = asyncio.run(run())
    assert time.monotonic() - start < 30
    c = client.check_conservation()
    terminal = c["trained"] + c["dropped_stale"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    assert c["in_flight"] == 0 and c["dispatched"] == terminal == num_prompts * group_size
    # Rewards 0/1 within every group: only a timeout removes samples (its partner is left alone in the group).
    assert c["trained"] + c["failed:timeout"] + c["filtered:too_few_members"] == num_prompts * group_size
    assert c["requeued"] >= 1 and c["failed:timeout"] >= 1 and c["trained"] >= num_prompts
    assert c["trained"] == len(lags) and max(lags) <= eta
    assert sum(client.staleness_histogram().values()) == c["trained"]


def test_get_batch_times_out_naming_the_queue_and_what_it_waited_for(ray_cluster):
    queue = start_replay_queue(BufferConfig(log_parquet=False), name="rq-timeout")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ReplayQueue 'rq-timeout'.*2 groups at learner version 3.*nothing in flight"):
        queue.get_batch(2, 3, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5

    queue.add_prompts([make_prompt()], 2)
    held = ray_cluster.get(queue.handle.acquire.remote("w-slow", 2))
    with pytest.raises(TimeoutError, match=r"requests held by workers: w-slow=2 \(oldest p0#0/0/0 held by w-slow"):
        queue.get_batch(1, 0, timeout_s=0.3)
    assert len(held) == 2


def test_a_queue_that_does_not_answer_in_time_is_named_with_the_call(ray_cluster):
    # A driver that waits 0.5 s less than the actor's own 1 s wait: the actor has not answered yet.
    queue = start_replay_queue(BufferConfig(log_parquet=False), name="rq-silent")
    impatient = QueueClient(queue.handle, "rq-silent", QueueTimeouts(batch_grace_s=-0.5))
    start = time.monotonic()
    with pytest.raises(QueueCallTimeout, match=r"ReplayQueue 'rq-silent': get_batch got no answer within 0.5s"):
        impatient.get_batch(1, 0, timeout_s=1.0)
    assert time.monotonic() - start < 1.0


def test_a_waiting_learner_wakes_at_the_straggler_timeout(ray_cluster):
    config = BufferConfig(group_timeout_s=0.5, straggler_policy="partial", filter_zero_variance=False, log_parquet=False)
    queue = start_replay_queue(config, name="rq-straggler")
    queue.add_prompts([make_prompt()], 4)
    requests = ray_cluster.get(queue.handle.acquire.remote("w0", 4))
    ray_cluster.get(queue.handle.put.remote([make_answer(r, 4, worker="w0", reward=float(r.sample_index), attempt=None) for r in requests[:2]]))
    start = time.monotonic()
    (group,) = queue.get_batch(1, 0, timeout_s=10.0).groups
    assert [t.sample_index for t in group.trajectories] == [0, 1]
    assert time.monotonic() - start < 3  # woke at the 0.5 s group timeout, not at the 10 s get_batch timeout
    ray_cluster.get(queue.handle.put.remote([make_answer(r, 4, worker="w0", attempt=None) for r in requests[2:]]))
    c = queue.check_conservation()
    assert (c["trained"], c["filtered:straggler"], c["in_flight"]) == (2, 2, 0)


def test_acquire_waits_for_prompts_and_returns_empty_at_its_timeout(ray_cluster):
    client = start_replay_queue(BufferConfig(log_parquet=False), name="rq-acquire")
    queue = client.handle
    assert ray_cluster.get(queue.acquire.remote("w0", 4, timeout_s=0.2)) == []
    pending = queue.acquire.remote("w0", 4, timeout_s=10.0)
    time.sleep(0.3)
    start = time.monotonic()
    client.add_prompts([make_prompt()], 3)
    assert len(ray_cluster.get(pending)) == 3
    assert time.monotonic() - start < 3


def test_packed_trajectories_go_through_the_actor_with_their_tokens_versions_and_lags(ray_cluster):
    client = start_replay_queue(BufferConfig(max_staleness=1, filter_zero_variance=False, log_parquet=False), batch_groups=2, name="rq-packed")
    client.add_prompts([make_prompt("a"), make_prompt("b")], 2)
    requests = ray_cluster.get(client.handle.acquire.remote("w0", 4))
    versions = {"a": [0, 1], "b": 1}  # min_version 0 and 1
    answers = [make_answer(r, [5, 6 + r.sample_index], versions=versions[r.prompt.prompt_id], worker="w0") for r in requests]
    assert ray_cluster.get(client.handle.put.remote(PackedTrajectories(answers))) == 4
    batch = client.get_batch(2, 1, timeout_s=10.0)
    assert [t.response_ids.tolist() for g in batch.groups for t in g.trajectories] == [[5, 6], [5, 7]] * 2
    assert [t.versions.tolist() for t in batch.groups[0].trajectories] == [[0, 1], [0, 1]]
    assert batch.lags == [1, 1, 0, 0]  # learner version 1 - min_version 0 (group a), 1 - 1 (group b)
    c = client.check_conservation()
    assert (c["trained"], c["in_flight"]) == (4, 0)


def test_the_client_reads_the_backlog_with_one_cheap_call(ray_cluster):
    client = start_replay_queue(BufferConfig(max_staleness=0, log_parquet=False), batch_groups=1, name="rq-backlog")
    client.add_prompts([make_prompt("a"), make_prompt("b")], 2)
    assert client.backlog_groups() == 2 == client.stats()["backlog_groups"]
    ray_cluster.get(client.handle.acquire.remote("w0", 2))  # admission (0 + 0 + 1) * 1: one group starts
    assert client.backlog_groups() == 1
