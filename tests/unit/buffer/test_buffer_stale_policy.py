"""What happens to a sample that would outlive eta (`buffer.stale_policy`), and the response lengths the queue
reports for generated and trained samples. One scenario throughout, with eta = 1 and one group per step:

    admission version 0: g0 (long, 10 tokens) and g1 (short, 2 tokens) start; (0 + 1 + 1) * 1 = 2 groups
    step 0: g1 is ready, g0 is not
    admission version 1: g2 (short, 2 tokens) starts
    step 1 is g0's last within the bound (1 - 0 = eta); at step 2 its lag would be 2 > eta.
"""

import asyncio

import pytest
from buffer_fakes import FakeClock, make_config, make_prompts

from asyncrl.buffer.actor import ReplayQueue
from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.buffer.ledger import LengthStats
from asyncrl.testing import make_answer


def scenario(policy: str):
    """The queue after step 0 and the start of g2: returns it with the requests of g0 and g2 (both still out)."""
    core = ReplayQueueCore(make_config(max_staleness=1, stale_policy=policy), batch_groups=1, clock=FakeClock())
    core.add_prompts(make_prompts(4), samples_per_prompt=1)
    g0, g1 = core.acquire("w-long", 1), core.acquire("w0", 1)
    core.put([make_answer(g1[0], 2, versions=0)])
    assert [g.group_id for g in core.get_batch(1, learner_version=0).groups] == [g1[0].group_id]
    core.set_version(1)
    (g2,) = core.acquire("w0", 1)
    return core, g0[0], g2


def test_wait_holds_the_step_that_is_a_samples_last_chance_and_then_trains_it_first():
    core, g0, g2 = scenario("wait")
    core.put([make_answer(g2, 2, versions=1)])
    assert core.awaited_requests(learner_version=1) == [("p0#0/0/0", "w-long")]
    assert core.get_batch(1, learner_version=1) is None  # g2 is ready, but training it would leave g0 behind
    core.put([make_answer(g0, 10, versions=0)])
    assert core.awaited_requests(learner_version=1) == []
    step1 = core.get_batch(1, learner_version=1)
    assert ([g.group_id for g in step1.groups], step1.lags) == ([g0.group_id], [1])  # oldest first, ahead of g2
    step2 = core.get_batch(1, learner_version=2)
    assert ([g.group_id for g in step2.groups], step2.lags) == ([g2.group_id], [1])
    c = core.check_conservation()
    assert (c["trained"], c["dropped_stale"], c["in_flight"]) == (3, 0, 0)
    assert core.staleness_histogram() == {0: 1, 1: 2}


def test_wait_does_not_hold_a_step_that_is_not_the_last_chance_of_anything():
    core, g0, g2 = scenario("wait")
    assert core.awaited_requests(learner_version=0) == []  # 0 - 0 < eta
    core.set_version(2)
    (g3,) = core.acquire("w0", 1)
    # At step 1, g2 (started at 1) and g3 (at 2) have steps to spare; only g0 (started at 0) is awaited.
    assert [rid for rid, _ in core.awaited_requests(learner_version=1)] == [f"{g0.group_id}/0/0"]
    core.put([make_answer(g0, 10, versions=0)])
    assert core.awaited_requests(learner_version=1) == []


def test_wait_names_a_request_not_yet_acquired_without_a_worker():
    core = ReplayQueueCore(make_config(max_staleness=0, stale_policy="wait"), batch_groups=1, clock=FakeClock())
    core.add_prompts(make_prompts(1), samples_per_prompt=2)
    core.acquire("w0", 1)
    assert core.awaited_requests(learner_version=0) == [("p0#0/0/0", "w0"), ("p0#0/1/0", None)]


def test_drop_never_waits_and_a_sample_started_at_v0_is_not_trained_at_v2():
    core, g0, g2 = scenario("drop")
    assert core.awaited_requests(learner_version=1) == []
    core.put([make_answer(g2, 2, versions=1)])
    assert [g.group_id for g in core.get_batch(1, learner_version=1).groups] == [g2.group_id]
    core.put([make_answer(g0, 10, versions=0)])
    assert core.get_batch(1, learner_version=2) is None  # lag 2 > eta 1: dropped at hand-out
    c = core.check_conservation()
    assert (c["trained"], c["dropped_stale"], c["in_flight"]) == (2, 1, 0)


def test_response_lengths_show_the_bias_of_drop_and_none_under_wait():
    lengths, trained_at = {}, {}
    for policy in ("drop", "wait"):
        core, g0, g2 = scenario(policy)
        core.put([make_answer(g2, 2, versions=1)])
        core.put([make_answer(g0, 10, versions=0)])  # both ready before step 1: only the hand-out order differs
        batches = [core.get_batch(1, learner_version=v) for v in (1, 2)]
        trained_at[policy] = [[g.group_id for g in b.groups] if b else [] for b in batches]
        lengths[policy] = core.response_lengths()
    assert trained_at["drop"] == [[g2.group_id], []]  # ready order; g0 then has lag 2 and is dropped
    assert trained_at["wait"] == [[g0.group_id], [g2.group_id]]  # oldest min_version first
    assert lengths["drop"].generated == LengthStats(count=3, mean=14 / 3, p50=2, p90=10, max=10)  # 10 + 2 + 2
    assert lengths["drop"].trained == LengthStats(count=2, mean=2.0, p50=2, p90=2, max=2)  # g0 dropped
    assert lengths["wait"].trained == lengths["wait"].generated == lengths["drop"].generated
    assert core.stats()["response_len_trained_mean"] == pytest.approx(14 / 3)


def test_length_stats_percentiles_are_nearest_rank():
    from collections import Counter

    # Sorted lengths 1 2 2 3 10: the 3rd of 5 is the median, the 5th (0.9 * 5 = 4.5 -> 5th) is p90.
    stats = LengthStats.from_histogram(Counter([1, 2, 2, 3, 10]))
    assert stats == LengthStats(count=5, mean=3.6, p50=2, p90=10, max=10)
    assert LengthStats.from_histogram(Counter()) == LengthStats(count=0, mean=0.0, p50=0, p90=0, max=0)


def test_a_wait_that_times_out_names_the_request_and_its_worker():
    async def scenario_on_the_actor() -> str:
        queue = ReplayQueue(make_config(max_staleness=0, stale_policy="wait"), name="rq-wait")
        await queue.add_prompts(make_prompts(1), samples_per_prompt=1)
        await queue.acquire("w-slow", 1)
        with pytest.raises(TimeoutError) as raised:
            await queue.get_batch(1, learner_version=0, timeout_s=0.05)
        return str(raised.value)

    message = asyncio.run(scenario_on_the_actor())
    assert "stale_policy wait" in message and "p0#0/0/0 (held by w-slow)" in message


def test_continue_never_waits_and_trains_a_long_sample_on_its_tokens_within_the_bound():
    import pickle

    core, g0, g2 = scenario("continue")
    assert core.awaited_requests(learner_version=1) == []
    core.put([make_answer(g2, 2, versions=1)])
    assert [g.group_id for g in core.get_batch(1, learner_version=1).groups] == [g2.group_id]  # g0 not awaited
    core.set_version(2)
    # g0 went on generating across two in-flight updates: 2 tokens at each of versions 0, 1 and 2.
    core.put([make_answer(g0, 6, versions=[0, 0, 1, 1, 2, 2])])
    step2 = core.get_batch(1, learner_version=2)
    (t,) = step2.groups[0].trajectories
    # At step 2 with eta 1 the oldest version allowed is 1: the two version-0 tokens leave the loss, stay as context.
    assert t.loss_mask.tolist() == [0, 0, 1, 1, 1, 1] and len(t.response_ids) == 6
    assert (t.min_version, step2.lags) == (1, [1])
    assert pickle.loads(pickle.dumps(step2)).lags == [1]  # the learner's side computes the same lag
    c = core.check_conservation()
    assert (c["trained"], c["dropped_stale"], c["stale_samples_masked"], c["stale_tokens_masked"]) == (3, 0, 1, 2)
    assert core.response_lengths().trained == core.response_lengths().generated  # 10 + 2 + 2 as under wait


def test_continue_drops_a_group_when_a_member_has_no_token_left_within_the_bound():
    core = ReplayQueueCore(make_config(max_staleness=1, stale_policy="continue"), batch_groups=1, clock=FakeClock())
    core.add_prompts(make_prompts(1), samples_per_prompt=2)
    a, b = core.acquire("w0", 2)
    core.set_version(1)
    core.set_version(2)
    core.put([make_answer(a, 3, versions=[0, 1, 2], reward=1.0), make_answer(b, 2, versions=[0, 0], reward=0.0)])
    assert core.get_batch(1, learner_version=2) is None  # b's every token has lag 2 > eta
    c = core.check_conservation()
    assert (c["trained"], c["dropped_stale"], c["stale_tokens_masked"]) == (0, 2, 0)


def test_a_lag_is_measured_over_trained_tokens_in_a_trajectory_and_in_columns():
    from asyncrl.testing import make_trajectory
    from asyncrl.types import TrajectoryColumns

    trajectories = [
        make_trajectory(4, versions=[3, 3, 4, 5], loss_mask=[0, 0, 1, 1]),  # oldest trained token: 4
        make_trajectory(3, versions=[2, 3, 3]),  # all trained: 2
        make_trajectory(2, versions=[6, 7], loss_mask=[0, 0]),  # none trained: every token counts, 6
        make_trajectory(0, dispatch_version=9),  # no tokens: the dispatch version
    ]
    assert [t.min_version for t in trajectories] == [4, 2, 6, 9]
    assert TrajectoryColumns.pack(trajectories).min_versions().tolist() == [4, 2, 6, 9]


@pytest.mark.parametrize("seed", range(40))
def test_continue_masks_exactly_the_trained_tokens_past_the_bound_or_drops_the_group(seed):
    """Random groups of long samples spanning versions (non-decreasing, as engines produce them), some with
    observation tokens already masked, handed out at a random learner version: every trained token is within
    eta, exactly the stale trained tokens left the loss, and a group is dropped only if a member kept nothing."""
    import numpy as np

    rng = np.random.default_rng(seed)
    eta, size = int(rng.integers(0, 3)), int(rng.integers(1, 4))
    core = ReplayQueueCore(make_config(max_staleness=eta, stale_policy="continue"), batch_groups=1, clock=FakeClock())
    core.add_prompts(make_prompts(1), samples_per_prompt=size)
    requests = core.acquire("w0", size)
    top = int(rng.integers(0, 6))
    for v in range(1, top + 1):
        core.set_version(v)
    answers = []
    for k, r in enumerate(requests):
        n = int(rng.integers(1, 9))
        versions = np.sort(rng.integers(0, top + 1, n))
        mask = (rng.random(n) < 0.8).astype(np.int8)
        mask[0] = 1  # a model turn comes first
        answers.append(make_answer(r, n, versions=versions, loss_mask=mask, reward=float(k % 2)))
    core.put(answers)
    learner_version = top + int(rng.integers(0, 2))
    oldest_allowed = learner_version - eta
    batch = core.get_batch(1, learner_version=learner_version)
    kept_nothing = any(not (a.loss_mask.astype(bool) & (a.versions >= oldest_allowed)).any() for a in answers)
    assert (batch is None) == kept_nothing
    c = core.check_conservation()
    if batch is None:
        assert (c["dropped_stale"], c["stale_tokens_masked"]) == (size, 0)
        return
    for before, after in zip(answers, batch.groups[0].trajectories):
        expected = before.loss_mask.astype(bool) & (before.versions >= oldest_allowed)
        assert after.loss_mask.astype(bool).tolist() == expected.tolist()
        assert after.versions.tolist() == before.versions.tolist() and after.response_ids.tolist() == before.response_ids.tolist()
    assert max(batch.lags) <= eta
    masked = sum(int((a.loss_mask.astype(bool) & (a.versions < oldest_allowed)).sum()) for a in answers)
    assert (c["trained"], c["stale_tokens_masked"]) == (size, masked)
