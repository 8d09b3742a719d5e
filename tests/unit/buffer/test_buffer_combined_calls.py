"""The combined actor calls: `put_and_acquire` does what `put` then `acquire` do, `set_version_and_get_batch` what
`set_version` then `get_batch` do, each with the same books as the two calls."""

import asyncio

from buffer_fakes import make_config, make_prompts

from asyncrl.buffer import ReplayQueue
from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.testing import make_answer
from asyncrl.types import PackedTrajectories


def twin_queues():
    """Two queues in the same state: 3 prompts of 2 samples, 1 group per step, eta 0, so admission lets 1 group
    be ahead ((0 + 0 + 1) * 1); w0 holds both members of p0#0."""
    cores = [ReplayQueueCore(make_config(max_staleness=0), batch_groups=1) for _ in range(2)]
    for core in cores:
        core.add_prompts(make_prompts(3), samples_per_prompt=2)
    held = [core.acquire("w0", 4) for core in cores]
    assert held[0] == held[1] and [r.request_id for r in held[0]] == ["p0#0/0/0", "p0#0/1/0"]
    return cores, held[0]


def answers(requests, worker="w0"):
    return PackedTrajectories([make_answer(r, reward=float(r.sample_index), worker=worker) for r in requests])


def test_put_and_acquire_hands_out_the_same_requests_and_keeps_the_same_books_as_put_then_acquire():
    (split, joint), held = twin_queues()
    late = make_answer(held[0], worker="w-gone")  # answers no request it holds: counted stale_attempt, not accepted

    assert split.put([*answers(held), late]) == 2 and split.acquire("w0", 4) == []
    exchange = joint.put_and_acquire([*answers(held), late], "w0", 4)
    assert (exchange.accepted, exchange.requests) == (2, [])  # p0#0 is ready: 1 group ahead, admission is full

    for core in (split, joint):
        assert [len(g.trajectories) for g in core.get_batch(1, learner_version=0).groups] == [2]
        core.set_version(1)  # (1 + 0 + 1) * 1 = 2 groups may be ahead: 1 consumed, room for 1 more
    split_requests = split.acquire("w0", 4)
    exchange = joint.put_and_acquire([], "w0", 4)
    assert exchange.accepted == 0 and exchange.requests == split_requests
    assert [r.request_id for r in split_requests] == ["p1#1/0/0", "p1#1/1/0"]
    assert joint.check_conservation() == split.check_conservation()
    counters = joint.counters()
    # 2 groups started (4 dispatched), 2 trained, 2 in flight; 1 stale answer; 4 acquired, 2 put.
    assert (counters["dispatched"], counters["trained"], counters["in_flight"]) == (4, 2, 2)
    assert (counters["stale_attempt"], counters["acquired"], counters["put"]) == (1, 4, 2)


def test_the_actor_puts_then_waits_for_requests_and_answers_at_once_when_asked_for_none():
    async def scenario() -> tuple:
        queue = ReplayQueue(make_config(max_staleness=0), batch_groups=1, name="rq-exchange")
        await queue.add_prompts(make_prompts(2), samples_per_prompt=2)
        held = await queue.acquire("w0", 4)
        closed = await queue.put_and_acquire(answers(held), "w0", 4, timeout_s=0.05)  # admission stays full
        nothing = await asyncio.wait_for(queue.acquire("w0", 0, timeout_s=60.0), timeout=5.0)
        waiting = asyncio.ensure_future(queue.put_and_acquire([], "w0", 4, timeout_s=60.0))
        await queue.get_batch(1, learner_version=0, timeout_s=1.0)
        await queue.set_version(1)  # opens admission: the waiting call wakes with p1's members
        opened = await asyncio.wait_for(waiting, timeout=5.0)
        return closed, nothing, opened, await queue.counters()

    closed, nothing, opened, counters = asyncio.run(scenario())
    assert (closed.accepted, closed.requests, nothing) == (2, [], [])
    assert opened.accepted == 0 and [r.request_id for r in opened.requests] == ["p1#1/0/0", "p1#1/1/0"]
    assert (counters["trained"], counters["in_flight"], counters["put"]) == (2, 2, 2)


def test_set_version_and_get_batch_opens_admission_for_the_version_and_hands_out_that_steps_batch():
    async def scenario() -> tuple:
        queue = ReplayQueue(make_config(max_staleness=0), batch_groups=1, name="rq-version-batch")
        await queue.add_prompts(make_prompts(2), samples_per_prompt=2)
        await queue.put(answers(await queue.acquire("w0", 4)))
        first = await queue.set_version_and_get_batch(0, 1, timeout_s=1.0)
        closed = await queue.acquire("w0", 4)  # 1 group consumed = (0 + 0 + 1) * 1: admission is full at version 0
        empty = await queue.set_version_and_get_batch(1, 1, timeout_s=0.05, min_groups=0)  # nothing ready yet
        return first, closed, empty, await queue.acquire("w0", 4), await queue.stats()

    first, closed, empty, opened, stats = asyncio.run(scenario())
    assert (first.version, first.lags, closed) == (0, [0, 0], [])
    assert (empty.version, empty.groups) == (1, [])
    assert [r.request_id for r in opened] == ["p1#1/0/0", "p1#1/1/0"] and stats["admission_version"] == 1


def test_a_waiting_acquire_ends_empty_when_its_worker_is_requeued_and_the_work_goes_to_another():
    async def scenario() -> tuple:
        queue = ReplayQueue(make_config(max_staleness=0), batch_groups=1, name="rq-requeued-waiter")
        await queue.add_prompts(make_prompts(2), samples_per_prompt=2)
        held = await queue.acquire("w0", 4)
        await queue.put(answers(held))
        await queue.get_batch(1, learner_version=0, timeout_s=1.0)
        # w1 waits for work (admission is full); it dies and the pool requeues it before admission opens.
        waiting = asyncio.ensure_future(queue.put_and_acquire([], "w1", 4, timeout_s=60.0))
        await asyncio.sleep(0.01)
        requeued = await queue.requeue_worker("w1")
        dead = await asyncio.wait_for(waiting, timeout=5.0)
        await queue.set_version(1)
        return requeued, dead, await queue.acquire("w2", 4), await queue.counters()

    requeued, dead, taken, counters = asyncio.run(scenario())
    assert (requeued, dead.requests) == (0, [])  # nothing was held; nothing handed to a caller that is gone
    assert [r.request_id for r in taken] == ["p1#1/0/0", "p1#1/1/0"]
    assert (counters["acquired"], counters["in_flight"]) == (4, 2)


def test_backlog_groups_answers_the_backlog_that_stats_reports():
    async def scenario() -> list[tuple[int, float]]:
        queue = ReplayQueue(make_config(max_staleness=0), batch_groups=1, name="rq-backlog")
        seen = [(await queue.backlog_groups(), (await queue.stats())["backlog_groups"])]
        await queue.add_prompts(make_prompts(3), samples_per_prompt=2)
        seen.append((await queue.backlog_groups(), (await queue.stats())["backlog_groups"]))
        await queue.acquire("w0", 2)  # admission (0 + 0 + 1) * 1 starts one group
        seen.append((await queue.backlog_groups(), (await queue.stats())["backlog_groups"]))
        return seen

    assert asyncio.run(scenario()) == [(0, 0), (3, 3), (2, 2)]
