"""The rollout worker's serving loop, driven in-process with a fake engine and a fake queue (no Ray, no vLLM)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.buffer import ReplayQueue
from asyncrl.config import BufferConfig, EnvConfig, RolloutConfig
from asyncrl.rollout.worker import RolloutWorker, WorkerSpec
from asyncrl.testing import make_prompt, make_request

from .fakes import FakeEngine, FakeQueue, InProcessHandle, make_requests


def crashing_reward(response, ground_truth, *, finish_reason, extra_info):
    if ground_truth == "boom":
        raise ZeroDivisionError("reward exploded")
    return 1.0 if response == ground_truth else 0.0


def slow_reward(response, ground_truth, *, finish_reason, extra_info):
    if ground_truth == "slow":
        time.sleep(0.5)
    return 1.0


def odd_reward(response, ground_truth, *, finish_reason, extra_info):
    """NaN for ground truth "nan", the text "1.0" for "text": bugs a reward can have."""
    return {"nan": float("nan"), "text": "1.0"}.get(ground_truth, 1.0)


def _worker(queue, *, max_in_flight=4, reward="exact_match", delay_s=0.01, reward_timeout_s=10.0):
    engine = FakeEngine("rollout-0", delay_s=delay_s)
    spec = WorkerSpec("unused", RolloutConfig(max_requests_in_flight=max_in_flight), EnvConfig(reward=reward, reward_timeout_s=reward_timeout_s))
    handle = None if queue is None else InProcessHandle(queue)
    worker = RolloutWorker("rollout-0", spec, handle, engine=engine)
    return worker, engine


async def _serve_until(worker, queue, n_finished, timeout_s=10.0):
    run = asyncio.ensure_future(worker.run())
    deadline = time.monotonic() + timeout_s
    while len(queue.finished) < n_finished and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await worker.stop(drain=True)
    return await run


def test_every_request_comes_back_once_with_its_reward_and_concurrency_stays_bounded():
    queue = FakeQueue(make_requests(20))
    worker, engine = _worker(queue, max_in_flight=4)
    stats = asyncio.run(_serve_until(worker, queue, 20))
    assert sorted(t.group_id for t in queue.finished) == sorted(f"g{i}" for i in range(20))
    assert all(t.reward == 1.0 and t.failure is None for t in queue.finished)
    assert not queue.in_flight and queue.late == 0
    assert engine.peak_running == 4  # continuous batching up to the bound, never more
    assert queue.put_calls < 20  # finished trajectories travel in batches
    assert stats["requests_done"] == 20 and stats["tokens_generated"] == 40
    assert stats["busy_s"] > 0


def test_each_finished_trajectory_rides_on_the_call_that_fills_its_slot():
    queue = FakeQueue(make_requests(3))
    worker, _ = _worker(queue, max_in_flight=1)
    asyncio.run(_serve_until(worker, queue, 3))
    assert sorted(t.group_id for t in queue.finished) == ["g0", "g1", "g2"]
    # One slot: each finish frees it at once, while the batching window of a separate put is still open.
    assert (worker.queue.calls["acquire"], worker.queue.calls["put"], queue.put_calls) == (0, 0, 3)
    assert worker.queue.calls["put_and_acquire"] >= 4  # the first one puts nothing; the last one gets nothing


class RecordingQueue(FakeQueue):
    """Records the `max_requests` of each `put_and_acquire` and how many requests the worker held then."""

    def __init__(self, requests) -> None:
        super().__init__(requests)
        self.asks: list[tuple[int, int]] = []

    def put_and_acquire(self, trajectories, worker, max_requests, timeout_s=0.0):
        self.asks.append((max_requests, len(self.in_flight) - len(trajectories)))
        return super().put_and_acquire(trajectories, worker, max_requests, timeout_s)


class StaggeredEngine(FakeEngine):
    """Sample k of a group takes (k + 1) x 5 ms: a group's slots free one at a time."""

    async def generate(self, request, sampling):
        self.delay_s = 0.005 * (request.sample_index + 1)
        return await super().generate(request, sampling)


def test_a_worker_with_requests_running_asks_for_work_only_with_a_whole_group_of_slots_free():
    requests = [make_request(make_prompt(f"p{g}", [1, 4, 5], "7"), group_id=f"g{g}", sample_index=k, group_size=4) for g in range(6) for k in range(4)]
    queue = RecordingQueue(requests)
    engine = StaggeredEngine("rollout-0")
    spec = WorkerSpec("unused", RolloutConfig(max_requests_in_flight=6), EnvConfig(reward="exact_match"))
    worker = RolloutWorker("rollout-0", spec, InProcessHandle(queue), engine=engine)
    asyncio.run(_serve_until(worker, queue, 24))
    assert len(queue.finished) == 24 and engine.peak_running <= 6
    assert queue.asks[0] == (6, 0)  # holding nothing: any free slots
    assert all(max_requests >= 4 for max_requests, held in queue.asks if held)  # otherwise a whole group's worth


class QueueFailingOnceWithTrajectories(FakeQueue):
    """A queue restarting just when the first finished trajectory comes back with an acquire."""

    def put_and_acquire(self, trajectories, worker, max_requests, timeout_s=0.0):
        if trajectories and not self.finished and not getattr(self, "failed_once", False):
            self.failed_once = True
            raise ConnectionError("replay queue restarting")
        return super().put_and_acquire(trajectories, worker, max_requests, timeout_s)


def test_trajectories_of_a_failed_hand_in_are_kept_and_handed_in_later():
    queue = QueueFailingOnceWithTrajectories(make_requests(1))

    async def scenario():
        worker, _ = _worker(queue, max_in_flight=1)
        with pytest.raises(ConnectionError):
            await worker.run()
        assert queue.finished == []
        await worker.stop(drain=True)  # the last flush puts what the failed call carried

    asyncio.run(scenario())
    assert [t.group_id for t in queue.finished] == ["g0"] and not queue.in_flight


def test_a_crashing_reward_fails_its_trajectory_with_the_reason_and_the_worker_keeps_serving():
    requests = make_requests(3) + make_requests(1, ground_truth="boom", prefix="b") + make_requests(3, prefix="h")
    queue = FakeQueue(requests)
    worker, _ = _worker(queue, max_in_flight=1, reward=f"{__name__}:crashing_reward")
    asyncio.run(_serve_until(worker, queue, 7))
    failed = [t for t in queue.finished if t.failed]
    assert [t.group_id for t in failed] == ["b0"]
    assert failed[0].failure == "reward_error: ZeroDivisionError: reward exploded"
    assert sum(t.reward for t in queue.finished) == 6.0  # the 6 others were scored and handed in after it


@pytest.mark.parametrize(("truth", "failure"), [("nan", "reward_error: non-finite reward nan"), ("text", "reward_error: returned str '1.0', not a number")])
def test_a_reward_of_nan_or_text_fails_its_trajectory_with_the_reason(truth, failure):
    queue = FakeQueue(make_requests(1, ground_truth=truth) + make_requests(1, prefix="h"))
    worker, _ = _worker(queue, reward=f"{__name__}:odd_reward")
    asyncio.run(_serve_until(worker, queue, 2))
    by_group = {t.group_id: t for t in queue.finished}
    assert by_group["g0"].failure == failure and by_group["h0"].failure is None and by_group["h0"].reward == 1.0


def test_a_reward_past_its_timeout_fails_the_trajectory():
    queue = FakeQueue(make_requests(1, ground_truth="slow") + make_requests(2, prefix="h"))
    worker, _ = _worker(queue, reward=f"{__name__}:slow_reward", reward_timeout_s=0.1)
    asyncio.run(_serve_until(worker, queue, 3))
    by_group = {t.group_id: t for t in queue.finished}
    assert by_group["g0"].failure == "reward_error: timed out after 0.1s"
    assert by_group["h0"].failure is None and by_group["h1"].reward == 1.0


def test_stop_without_drain_drops_running_requests_and_requeue_recovers_them():
    queue = FakeQueue(make_requests(6))

    async def scenario():
        worker, _ = _worker(queue, max_in_flight=3, delay_s=5.0)
        run = asyncio.ensure_future(worker.run())
        while len(queue.in_flight) < 3:
            await asyncio.sleep(0.01)
        dropped = await worker.stop(drain=False)
        await run
        return dropped

    dropped = asyncio.run(scenario())
    assert dropped == 3 and queue.finished == []
    assert queue.requeue_worker("rollout-0") == 3
    assert len(queue.pending) == 6 and not queue.in_flight  # 3 re-queued (attempt 1) + 3 never dispatched
    assert sorted(r.attempt for r in queue.pending) == [0, 0, 0, 1, 1, 1]


def test_empty_acquire_is_back_pressure_the_worker_waits_and_serves_later_arrivals():
    queue = FakeQueue()

    async def scenario():
        worker, _ = _worker(queue)
        run = asyncio.ensure_future(worker.run())
        await asyncio.sleep(0.1)
        assert queue.finished == []
        queue.pending.extend(make_requests(2))
        deadline = time.monotonic() + 5
        while len(queue.finished) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await worker.stop(drain=True)
        return await run

    stats = asyncio.run(scenario())
    assert len(queue.finished) == 2
    assert stats["idle_s"] > 0.05



def test_a_worker_waiting_for_work_takes_it_on_the_call_already_waiting_when_admission_opens():
    """With nothing admitted, the worker's slot call waits inside the (real, in-process) replay queue: the
    requests of the group admitted at the next version go out on that call, not on a poll made afterwards
    (with sleeps between polls, the engine would idle for the rest of a sleep)."""
    config = BufferConfig(max_staleness=0, filter_zero_variance=False, log_parquet=False)

    async def scenario():
        queue = ReplayQueue(config, batch_groups=1, name="rq-long-poll")
        await queue.add_prompts([make_prompt(f"p{k}", ground_truth="7") for k in range(2)], samples_per_prompt=2)
        worker, _ = _worker(queue, max_in_flight=2, delay_s=0.5)  # a group fills the slots for 0.5 s
        handle = worker.queue
        run = asyncio.ensure_future(worker.run())
        batch = await queue.get_batch(1, learner_version=0, timeout_s=5.0)  # p0's group: admission is full now
        calls = handle.calls["put_and_acquire"]
        deadline = time.monotonic() + 5
        while handle.calls["put_and_acquire"] == calls and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # until a fresh call is waiting (far from its QUEUE_WAIT_S end)
        calls = handle.calls["put_and_acquire"]
        await queue.set_version(1)
        while (await queue.counters())["acquired"] < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        taken_by = handle.calls["put_and_acquire"] - calls
        await worker.stop(drain=True)
        await run
        return batch, taken_by, await queue.counters()

    batch, new_calls, counters = asyncio.run(scenario())
    assert batch.num_samples == 2 and counters["acquired"] == 4
    assert new_calls == 0  # p1's members went out on the call that was waiting when version 1 came
    assert (counters["put"], counters["in_flight"]) == (4, 2)  # p1's answers are in, its group ready

def test_run_without_a_queue_is_refused():
    worker, _ = _worker(None)
    with pytest.raises(RuntimeError, match="needs a queue"):
        asyncio.run(worker.run())


def test_a_prompts_extra_info_overrides_max_tokens_and_ignore_eos_for_that_request_only():
    class RecordingEngine(FakeEngine):
        def __init__(self, name):
            super().__init__(name)
            self.specs = {}

        async def generate(self, request, sampling):
            self.specs[request.group_id] = sampling
            return await super().generate(request, sampling)

    long = make_request(make_prompt("p-long", [1, 4], "7", extra_info={"max_tokens": 300, "ignore_eos": True}), group_id="long")
    plain = make_requests(1)
    queue = FakeQueue([long] + plain)
    engine = RecordingEngine("rollout-0")
    worker = RolloutWorker("rollout-0", WorkerSpec("unused", RolloutConfig(max_tokens=8, temperature=0.7)), InProcessHandle(queue), engine=engine)
    asyncio.run(_serve_until(worker, queue, 2))
    assert (engine.specs["long"].max_tokens, engine.specs["long"].ignore_eos) == (300, True)
    assert engine.specs["long"].temperature == 0.7  # everything else comes from the worker's spec
    assert engine.specs["g0"] is worker.sampling and (worker.sampling.max_tokens, worker.sampling.ignore_eos) == (8, False)


@pytest.mark.parametrize(("max_staleness", "in_flight", "calls"), [(2, True, [2]), (2, False, []), (None, True, [])])
def test_an_in_flight_weight_update_aborts_requests_certain_to_exceed_the_bound(max_staleness, in_flight, calls):
    class UpdatingEngine(FakeEngine):
        def __init__(self, name):
            super().__init__(name)
            self.abort_calls = []

        async def update_weights(self, buckets, version, in_flight=True):
            self.version = version

        async def abort_stale(self, max_staleness):
            self.abort_calls.append(max_staleness)
            return 3

    engine = UpdatingEngine("rollout-0")
    worker = RolloutWorker("rollout-0", WorkerSpec("unused", abort_after_lag=max_staleness), None, engine=engine)
    before = time.time()
    load = asyncio.run(worker.update_weights([b""], 5, in_flight=in_flight))
    assert load.version == 5 and before <= load.served_at <= time.time()
    assert engine.abort_calls == calls
    assert asyncio.run(worker.stats())["stale_aborts"] == 3 * len(calls)


@pytest.mark.parametrize("fork", [True, False])
def test_the_worker_builds_its_engine_from_the_rollout_config(fork):
    rollout = RolloutConfig(max_requests_in_flight=7, weight_load="reload", group_requests=False, fork_engine_core=fork)
    engine = WorkerSpec(model_dir="/models/m", rollout=rollout, seed=3).build_engine("rollout-4")
    assert (engine.name, engine.model_dir, engine._engine_kwargs["max_num_seqs"], engine._engine_kwargs["seed"]) == ("rollout-4", "/models/m", 7, 3)
    assert (engine._weight_load, engine._group_requests, engine._fork_core) == ("reload", False, fork)
