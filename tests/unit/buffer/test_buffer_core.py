"""Scenario tests of ReplayQueueCore: readiness, filters, stragglers, admission, staleness, requeue, resume."""

import json
import pickle

import pytest
from buffer_fakes import FakeClock, make_config, make_prompts

from asyncrl.buffer.core import ConservationError, ReplayQueueCore
from asyncrl.testing import make_answer
from asyncrl.types import PackedTrajectories

# Rewards with variance, so the zero-variance filter leaves the group alone.
MIXED = [1.0, 0.0, 1.0, 0.0]


def started_queue(num_prompts=1, group_size=4, batch_groups=1, clock=None, **config):
    config.setdefault("max_staleness", 8)
    core = ReplayQueueCore(make_config(**config), batch_groups=batch_groups, clock=clock or FakeClock())
    core.add_prompts(make_prompts(num_prompts), samples_per_prompt=group_size)
    return core


def put_all(core, requests, rewards=None, worker="w0", **kw):
    rewards = rewards or [float(r.sample_index % 2) for r in requests]
    return core.put([make_answer(r, reward=x, worker=worker, **kw) for r, x in zip(requests, rewards)])


# ---------------------------------------------------------------------------------------------------
# Readiness.


def test_a_group_is_ready_only_when_every_member_arrived():
    core = started_queue(group_size=4)
    requests = core.acquire("w0", 10)
    assert [r.request_id for r in requests] == [f"p0#0/{i}/0" for i in range(4)]
    put_all(core, requests[:3], rewards=MIXED[:3])
    assert core.get_batch(1, learner_version=0) is None
    put_all(core, requests[3:], rewards=MIXED[3:])
    (group,) = core.get_batch(1, learner_version=0).groups
    assert [t.sample_index for t in group.trajectories] == [0, 1, 2, 3]
    c = core.check_conservation()
    assert (c["dispatched"], c["trained"], c["in_flight"]) == (4, 4, 0)


def test_a_single_trajectory_is_ready_on_arrival():
    core = started_queue(num_prompts=3, group_size=1, batch_groups=3)
    requests = core.acquire("w0", 10)
    assert len(requests) == 3
    put_all(core, requests[1:2], rewards=[1.0])
    (group,) = core.get_batch(1, learner_version=0).groups
    assert group.group_id == requests[1].group_id and len(group.trajectories) == 1
    c = core.check_conservation()
    assert (c["dispatched"], c["trained"], c["in_flight"]) == (3, 1, 2)


def test_get_batch_hands_out_nothing_until_num_groups_are_ready_unless_min_groups():
    core = started_queue(num_prompts=3, group_size=1, batch_groups=3)
    put_all(core, core.acquire("w0", 2), rewards=[1.0, 0.0])
    assert core.get_batch(3, learner_version=0) is None
    assert core.counters()["trained"] == 0
    assert len(core.get_batch(3, learner_version=0, min_groups=2).groups) == 2
    assert core.counters()["trained"] == 2


# ---------------------------------------------------------------------------------------------------
# Filters, each counted by reason.


def test_a_failed_trajectory_is_counted_by_reason_and_leaves_its_group():
    core = started_queue(group_size=3)
    requests = core.acquire("w0", 3)
    core.put([make_answer(requests[0], failure="reward_error: division by zero"), make_answer(requests[1], reward=1.0), make_answer(requests[2])])
    (group,) = core.get_batch(1, learner_version=0).groups
    assert [t.sample_index for t in group.trajectories] == [1, 2]
    c = core.check_conservation()
    assert (c["failed:reward_error"], c["trained"], c["in_flight"]) == (1, 2, 0)


def test_a_group_left_with_one_member_is_filtered_as_too_few():
    core = started_queue(group_size=3)
    requests = core.acquire("w0", 3)
    core.put([make_answer(requests[0], failure="timeout"), make_answer(requests[1], failure="timeout"), make_answer(requests[2], reward=1.0)])
    assert core.get_batch(1, learner_version=0, min_groups=0).groups == []
    c = core.check_conservation()
    assert (c["failed:timeout"], c["filtered:too_few_members"], c["trained"]) == (2, 1, 0)


@pytest.mark.parametrize("enabled, trained, filtered", [(True, 0, 4), (False, 4, 0)])
def test_a_zero_variance_group_is_filtered_when_enabled(enabled, trained, filtered):
    core = started_queue(group_size=4, filter_zero_variance=enabled)
    put_all(core, core.acquire("w0", 4), rewards=[1.0, 1.0, 1.0, 1.0])
    core.get_batch(1, learner_version=0, min_groups=0)
    c = core.check_conservation()
    assert (c["trained"], c.get("filtered:zero_variance", 0)) == (trained, filtered)


@pytest.mark.parametrize("enabled, trained, filtered", [(True, 3, 1), (False, 4, 0)])
def test_overlong_trajectories_are_filtered_one_by_one_when_enabled(enabled, trained, filtered):
    core = started_queue(group_size=4, filter_overlong=enabled)
    requests = core.acquire("w0", 4)
    core.put([make_answer(r, reward=MIXED[r.sample_index], finish_reason="length" if r.sample_index == 2 else "stop") for r in requests])
    core.get_batch(1, learner_version=0, min_groups=0)
    c = core.check_conservation()
    assert (c["trained"], c.get("filtered:overlong", 0)) == (trained, filtered)


def test_pass_rate_curriculum_retires_a_solved_prompt_and_skips_its_backlog():
    # eta = 0 and B = 1: one group at a time, so the second epoch of p0 is still in the backlog.
    core = ReplayQueueCore(make_config(max_staleness=0, pass_rate_curriculum=True, pass_rate_threshold=0.75), clock=FakeClock())
    p0, p1 = make_prompts(2)
    core.add_prompts([p0, p0, p1], samples_per_prompt=4)
    requests = core.acquire("w0", 10)
    assert {r.group_id for r in requests} == {"p0#0"}
    put_all(core, requests, rewards=[1.0, 1.0, 1.0, 0.0])  # pass rate 3/4 = 0.75 >= 0.75
    assert len(core.get_batch(1, learner_version=0).groups) == 1
    core.set_version(1)
    assert {r.group_id for r in core.acquire("w0", 10)} == {"p1#1"}  # p0's second group was skipped
    assert core.add_prompts([p0], samples_per_prompt=4) == 0
    c = core.check_conservation()
    assert (c["retired_prompts"], c["skipped_retired"], c["dispatched"]) == (1, 2, 8)


def test_pass_rate_below_threshold_keeps_the_prompt():
    core = ReplayQueueCore(make_config(max_staleness=0, pass_rate_curriculum=True, pass_rate_threshold=0.9), clock=FakeClock())
    p0 = make_prompts(1)[0]
    core.add_prompts([p0, p0], samples_per_prompt=4)
    put_all(core, core.acquire("w0", 10), rewards=[1.0, 1.0, 1.0, 0.0])
    core.get_batch(1, learner_version=0)
    core.set_version(1)
    assert {r.group_id for r in core.acquire("w0", 10)} == {"p0#1"}
    assert core.counters().get("retired_prompts", 0) == 0


# ---------------------------------------------------------------------------------------------------
# Stragglers (fake clock).


def test_straggler_drop_filters_the_whole_group_including_late_members():
    clock = FakeClock()
    core = started_queue(group_size=4, clock=clock, group_timeout_s=10.0, straggler_policy="drop")
    requests = core.acquire("w0", 3)  # member 3 is never acquired
    put_all(core, requests[:2], rewards=[1.0, 0.0])
    clock.advance(9.9)
    core.expire_stragglers()
    assert core.counters().get("filtered:straggler", 0) == 0
    clock.advance(0.1)
    assert core.get_batch(1, learner_version=0) is None
    c = core.check_conservation()
    # 2 arrived + 1 never acquired end now; the member still out stays in flight until it arrives.
    assert (c["filtered:straggler"], c["in_flight"], c["straggler_groups"]) == (3, 1, 1)
    put_all(core, requests[2:3])
    c = core.check_conservation()
    assert (c["filtered:straggler"], c["in_flight"], c["trained"]) == (4, 0, 0)


def test_straggler_partial_hands_out_finished_members_and_filters_late_ones():
    clock = FakeClock()
    core = started_queue(group_size=4, clock=clock, group_timeout_s=10.0, straggler_policy="partial")
    requests = core.acquire("w0", 4)
    put_all(core, requests[:2], rewards=[1.0, 0.0])
    clock.advance(10.0)
    (group,) = core.get_batch(1, learner_version=0).groups
    assert [t.sample_index for t in group.trajectories] == [0, 1]
    put_all(core, requests[2:])
    c = core.check_conservation()
    assert (c["trained"], c["filtered:straggler"], c["in_flight"]) == (2, 2, 0)


def test_straggler_partial_with_one_finished_member_drops_the_group():
    clock = FakeClock()
    core = started_queue(group_size=4, clock=clock, group_timeout_s=10.0, straggler_policy="partial")
    requests = core.acquire("w0", 4)
    put_all(core, requests[:1])
    clock.advance(10.0)
    assert core.get_batch(1, learner_version=0, min_groups=0).groups == []
    assert core.counters()["filtered:straggler"] == 1
    put_all(core, requests[1:])
    c = core.check_conservation()
    assert (c["filtered:straggler"], c["in_flight"]) == (4, 0)


def test_a_straggler_member_held_by_a_lost_worker_takes_the_group_fate():
    clock = FakeClock()
    core = started_queue(group_size=2, clock=clock, group_timeout_s=5.0)
    first, second = core.acquire("w0", 1)[0], core.acquire("w1", 1)[0]
    put_all(core, [first])
    clock.advance(5.0)
    core.expire_stragglers()
    assert core.requeue_worker("w1") == 0
    c = core.check_conservation()
    assert (c["filtered:straggler"], c["in_flight"]) == (2, 0)
    assert core.put([make_answer(second, worker="w1")]) == 0  # the late answer of a finished sample is ignored
    assert core.counters()["stale_attempt"] == 1


# ---------------------------------------------------------------------------------------------------
# Admission control and the staleness check.


def test_admission_with_eta_0_starts_only_b_groups_per_learner_version():
    core = started_queue(num_prompts=10, group_size=2, batch_groups=2, max_staleness=0)
    first = core.acquire("w0", 100)
    assert len({r.group_id for r in first}) == 2 and len(first) == 4  # (0 + 0 + 1) * 2 groups
    assert core.acquire("w0", 100) == []
    put_all(core, first)
    assert len(core.get_batch(2, learner_version=0).groups) == 2
    assert core.acquire("w0", 100) == []  # consumed but the version has not advanced
    core.set_version(1)
    second = core.acquire("w0", 100)
    assert len({r.group_id for r in second}) == 2 and len(second) == 4
    assert core.counters()["groups_started"] == 4


def test_admission_with_eta_2_allows_eta_plus_one_steps_of_groups():
    core = started_queue(num_prompts=20, group_size=2, batch_groups=2, max_staleness=2)
    assert len({r.group_id for r in core.acquire("w0", 100)}) == 6  # (0 + 2 + 1) * 2
    core.set_version(3)
    assert len({r.group_id for r in core.acquire("w0", 100)}) == 6  # (3 + 2 + 1) * 2 = 12 in all


def test_held_admission_starts_no_group_but_hands_out_the_started_ones():
    core = started_queue(num_prompts=4, group_size=2, batch_groups=1, max_staleness=8)
    first = core.acquire("w0", 1)  # a worker holding nothing gets a whole group: p0's 2 members start, 1 handed out
    core.hold_admission(True)
    assert [r.request_id for r in core.acquire("w0", 4)] == ["p0#0/1/0"]
    assert core.acquire("w0", 4) == [] and core.counters()["groups_started"] == 1
    core.hold_admission(False)
    assert [r.group_id for r in core.acquire("w0", 4)] == ["p1#1"] * 2 + ["p2#2"] * 2 and len(first) == 1


def test_capacity_caps_ready_groups():
    core = started_queue(num_prompts=10, group_size=1, batch_groups=1, max_staleness=100, capacity_groups=2)
    put_all(core, core.acquire("w0", 2))
    assert core.acquire("w0", 5) == []
    core.get_batch(1, learner_version=0)
    assert len(core.acquire("w0", 5)) == 5  # one ready group left < capacity 2


def test_new_groups_wait_while_a_learner_batch_is_ready():
    core = started_queue(num_prompts=10, group_size=1, batch_groups=2, max_staleness=100, max_ready_batches=1)
    first = core.acquire("w0", 3)
    assert len(first) == 3  # nothing ready yet: eta alone limits the lead
    put_all(core, first[:2])
    assert core.acquire("w0", 5) == []  # one batch (2 groups) is ready for the learner
    assert (core.stats()["ready_hold"], core.stats()["ready_limit_groups"]) == (1.0, 2)
    put_all(core, first[2:])
    assert len(core.get_batch(2, learner_version=0).groups) == 2
    assert len(core.acquire("w0", 5)) == 5  # one ready group left, less than a batch
    assert core.stats()["ready_hold"] == 0.0


def test_new_groups_start_while_the_learners_step_waits_for_an_old_group():
    core = started_queue(num_prompts=10, group_size=1, batch_groups=2, max_staleness=1, max_ready_batches=1)  # eta: 4 groups
    old, *rest = core.acquire("w0", 3)
    put_all(core, rest)
    assert core.acquire("w0", 5) == []  # a batch is ready and the learner has not asked
    assert core.get_batch(2, learner_version=1) is None  # step 1 must wait for the group started at version 0
    fourth = core.acquire("w0", 5)
    assert len(fourth) == 1  # so a ready batch stops nothing; eta's fourth group starts
    put_all(core, [old, *fourth])
    assert len(core.get_batch(2, learner_version=1).groups) == 2  # the wait is over


def test_after_a_hand_out_the_wait_gate_is_that_of_the_next_step():
    core = started_queue(num_prompts=10, group_size=1, batch_groups=1, max_staleness=1, max_ready_batches=1)
    old, first = core.acquire("w0", 2)
    put_all(core, [first])
    assert core.get_batch(1, learner_version=0).groups[0].group_id == first.group_id
    core.set_version(1)
    put_all(core, core.acquire("w0", 5))  # one more group within eta, now ready: a batch
    core.set_version(2)
    # Step 1, the next, must wait for `old` (started at version 0): the ready batch stops nothing.
    assert len(core.acquire("w0", 5)) == 1


def test_a_stale_group_is_dropped_at_hand_out_and_never_returned():
    core = started_queue(num_prompts=3, group_size=1, batch_groups=3, max_staleness=1)
    a, b, c_ = core.acquire("w0", 3)
    core.put([make_answer(a, versions=0), make_answer(b, versions=[0, 1, 2]), make_answer(c_, versions=1)])
    # At learner version 2: a has lag 2 > 1 (dropped), b has min_version 0 (dropped), c has lag 1.
    (group,) = core.get_batch(1, learner_version=2).groups
    assert group.group_id == c_.group_id
    c = core.check_conservation()
    assert (c["dropped_stale"], c["trained"], c["groups_dropped_stale"]) == (2, 1, 2)
    assert core.staleness_histogram() == {1: 1}


def test_trajectories_put_over_the_wire_keep_tokens_versions_and_the_staleness_check():
    core = started_queue(num_prompts=3, group_size=2, batch_groups=3, max_staleness=1)
    requests = core.acquire("w0", 6)
    versions = {0: 0, 1: [1, 2], 2: 2}  # group k's token versions: min_version 0, 1, 2
    sent = [make_answer(r, [10 + r.sample_index, 20], versions=versions[k // 2], reward=float(r.sample_index), worker="w0")
            for k, r in enumerate(requests)]  # fmt: skip
    buffers = []
    wire = pickle.dumps(PackedTrajectories(sent), protocol=5, buffer_callback=buffers.append)
    assert core.put(pickle.loads(wire, buffers=buffers)) == 6
    # At learner version 2: group 0 has lag 2 > 1 (dropped), groups 1 and 2 lag 1 and 0.
    batch = core.get_batch(2, learner_version=2)
    assert [g.group_id for g in batch.groups] == [requests[2].group_id, requests[4].group_id]
    assert [t.response_ids.tolist() for g in batch.groups for t in g.trajectories] == [[10, 20], [11, 20]] * 2
    assert [t.versions.tolist() for t in batch.groups[0].trajectories] == [[1, 2], [1, 2]]
    assert batch.lags == [1, 1, 0, 0]
    c = core.check_conservation()
    assert (c["dropped_stale"], c["trained"], c["in_flight"]) == (2, 4, 0)


def test_a_member_aborted_as_certainly_stale_drops_its_whole_group_at_once():
    core = started_queue(num_prompts=2, group_size=4, batch_groups=1, max_staleness=1)
    doomed, other = core.acquire("w0", 4), core.acquire("w0", 4)
    core.put([make_answer(doomed[0], reward=1.0)])  # arrived before its sibling was aborted
    core.put([make_answer(doomed[1], failure="stale: first token at version 0, engine serves 2, max_staleness 1", finish_reason="abort")])
    c = core.check_conservation()
    # The aborted member, the one already in, and neither of the two still out: those end when they come back.
    assert (c["dropped_stale"], c["groups_dropped_stale"], c["in_flight"]) == (2, 1, 6)
    assert not any(k.startswith("failed:") for k in c)
    core.put([make_answer(r) for r in doomed[2:]])
    put_all(core, other, rewards=MIXED)
    (group,) = core.get_batch(1, learner_version=0).groups
    assert group.group_id == other[0].group_id
    c = core.check_conservation()
    assert (c["dropped_stale"], c["trained"], c["in_flight"], c["stale_attempt"]) == (4, 4, 0, 0)
    assert core.get_batch(1, learner_version=0) is None


def test_put_to_get_latency_is_measured_on_the_queue_clock():
    clock = FakeClock()
    core = started_queue(num_prompts=2, group_size=1, batch_groups=2, clock=clock)
    requests = core.acquire("w0", 2)
    put_all(core, requests[:1])
    clock.advance(1.0)
    put_all(core, requests[1:])
    clock.advance(2.0)
    core.get_batch(2, learner_version=0)
    lat = core.latency_stats()
    assert (lat["count"], lat["max"], lat["p50"]) == (2, 3.0, 2.5)  # latencies 3 s and 2 s


# ---------------------------------------------------------------------------------------------------
# Worker loss, shutdown, checkpoint.


def test_requests_of_a_lost_worker_are_redispatched_once_and_late_answers_ignored():
    core = started_queue(group_size=2)
    lost = core.acquire("w0", 2)
    assert core.requeue_worker("w0") == 2
    again = core.acquire("w1", 5)
    assert [r.request_id for r in again] == ["p0#0/0/1", "p0#0/1/1"]
    assert core.put([make_answer(r, worker="w0") for r in lost]) == 0
    assert core.put([make_answer(r, reward=float(r.sample_index), worker="w1") for r in again]) == 2
    core.get_batch(1, learner_version=0)
    c = core.check_conservation()
    assert (c["dispatched"], c["trained"], c["stale_attempt"], c["requeued"], c["in_flight"]) == (2, 2, 2, 2, 0)


def test_a_restarted_worker_with_the_same_name_is_told_apart_by_the_attempt():
    core = started_queue(group_size=2)
    lost = core.acquire("w0", 2)
    assert core.requeue_worker("w0") == 2
    again = core.acquire("w0", 5)  # the replacement kept the name and got the same samples back
    assert [r.attempt for r in again] == [1, 1]
    assert core.put([make_answer(r, worker="w0") for r in lost]) == 0  # the dead life's answers (attempt 0)
    assert core.put([make_answer(r, worker="w0", attempt=None) for r in lost[:1]]) == 1  # no attempt: matched by name
    assert core.put([make_answer(r, worker="w0") for r in again]) == 1  # sample 0 is already answered
    core.get_batch(1, learner_version=0)
    c = core.check_conservation()
    assert (c["dispatched"], c["trained"], c["stale_attempt"], c["requeued"], c["in_flight"]) == (2, 2, 3, 2, 0)


def test_check_conservation_raises_when_a_count_goes_missing():
    core = started_queue(group_size=2)
    core.acquire("w0", 2)
    core.ledger.counts["dispatched"] += 1
    with pytest.raises(ConservationError, match="dispatched 3 != .*in_flight 2"):
        core.check_conservation()


def test_state_dict_round_trip_redispatches_in_flight_work_and_keeps_conservation():
    core = started_queue(num_prompts=6, group_size=2, batch_groups=2, max_staleness=1, pass_rate_curriculum=True, pass_rate_threshold=1.0)
    requests = core.acquire("w0", 100)  # 4 groups: (0 + 1 + 1) * 2
    put_all(core, requests[:4], rewards=[1.0, 1.0, 0.0, 1.0])  # p0 solved -> retired; 2 groups ready
    core.get_batch(1, learner_version=0)  # 1 group trained
    put_all(core, requests[4:5])  # p2 half arrived; p3 out
    before = core.check_conservation()
    assert (before["dispatched"], before["trained"], before["in_flight"]) == (8, 2, 6)

    state = json.loads(json.dumps(core.state_dict()))
    resumed = ReplayQueueCore(make_config(max_staleness=1, pass_rate_curriculum=True, pass_rate_threshold=1.0), clock=FakeClock())
    resumed.load_state_dict(state)
    c = resumed.check_conservation()
    assert (c["dispatched"], c["trained"], c["in_flight"], c["retired_prompts"]) == (2, 2, 0, 1)
    # The ready group (p1) and in-flight groups (p2, p3) go first, ahead of the backlog (p4, p5); admission
    # still counts the consumed group: 1 + 3 = (0 + 1 + 1) * 2 - 0 leaves room for exactly these 3.
    again = resumed.acquire("w9", 100)
    assert [r.prompt.prompt_id for r in again[::2]] == ["p1", "p2", "p3"]
    assert resumed.batch_groups == 2 and again[0].group_id == "p1#4"
    put_all(resumed, again, worker="w9")
    assert len(resumed.get_batch(3, learner_version=0).groups) == 3
    c = resumed.check_conservation()
    assert (c["dispatched"], c["trained"], c["in_flight"]) == (8, 8, 0)


def test_get_batch_carries_each_samples_lag_and_never_moves_the_admission_version():
    core = started_queue(group_size=2, batch_groups=1, max_staleness=2)
    first, second = core.acquire("w0", 2)
    core.put([make_answer(first, 2, reward=1.0, versions=[0, 1]), make_answer(second, versions=1)])
    batch = core.get_batch(1, learner_version=2)
    assert (batch.version, batch.lags, batch.num_samples) == (2, [2, 1], 2)  # 2 - 0 and 2 - 1
    assert (batch.staleness_mean, batch.staleness_max) == (1.5, 2)
    assert core.admission_version == 0 and core.admission_limit() == 3  # (0 + 2 + 1) * 1: the learner's 2 is not a sync
    assert core.stats()["staleness_mean"] == 1.5
    with pytest.raises(ValueError, match="went back from 0 to -1"):
        core.set_version(-1)


def test_a_new_group_is_handed_out_whole_unless_the_worker_holds_nothing():
    core = started_queue(num_prompts=6, group_size=4, batch_groups=8)
    assert [r.group_id for r in core.acquire("w0", 6)] == ["p0#0"] * 4  # a second group would not fit in 2
    assert core.acquire("w0", 3) == []  # holding a group, 3 slots: nothing starts
    assert [r.group_id for r in core.acquire("w1", 2)] == ["p1#1"] * 2  # holds nothing: a part of a group
    assert [(r.group_id, r.sample_index) for r in core.acquire("w0", 5)] == [("p1#1", 2), ("p1#1", 3)]  # started ones first
    assert [r.group_id for r in core.acquire("w0", 8)] == ["p2#2"] * 4 + ["p3#3"] * 4
