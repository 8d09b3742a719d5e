"""Property test: random interleavings of every queue operation never break staleness or conservation.

A small simulated rollout pool (3 workers, engines whose weights lag the learner by a random amount) and
a learner drive `ReplayQueueCore` with random arrival orders, failures, overlong answers, version bumps,
lost workers with late answers, straggler timeouts, checkpoint/resume, and get_batch calls.
"""

from collections import Counter

from buffer_fakes import FakeClock, make_config, make_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.testing import make_answer

WORKERS = ["w0", "w1", "w2"]
"""Worker slots; a lost worker is replaced by a new incarnation with a new name (`w0.1`)."""
OPS = ["acquire", "acquire", "put", "put", "put", "late_put", "requeue", "tick", "bump", "bump", "get", "get", "add", "checkpoint"]
TIMEOUT_S = 10.0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    group_size=st.sampled_from([1, 2, 4]),
    eta=st.integers(0, 2),
    batch_groups=st.integers(1, 3),
    policy=st.sampled_from(["drop", "partial"]),
    stale_policy=st.sampled_from(["drop", "wait", "continue"]),
    zero_variance=st.booleans(),
    overlong=st.booleans(),
    curriculum=st.booleans(),
)
def test_random_interleavings_never_hand_out_stale_samples_and_always_conserve(
    data, group_size, eta, batch_groups, policy, stale_policy, zero_variance, overlong, curriculum
):
    config = make_config(
        max_staleness=eta,
        group_timeout_s=TIMEOUT_S,
        straggler_policy=policy,
        stale_policy=stale_policy,
        filter_zero_variance=zero_variance,
        filter_overlong=overlong,
        pass_rate_curriculum=curriculum,
        pass_rate_threshold=0.75,
    )
    clock = FakeClock()
    core = ReplayQueueCore(config, batch_groups=batch_groups, clock=clock)
    core.add_prompts(make_prompts(8), group_size)
    held: dict[str, list] = {w: [] for w in WORKERS}
    names = {slot: slot for slot in WORKERS}
    abandoned: list = []  # (request, worker) of attempts whose worker was lost
    trained: set[tuple[str, int]] = set()
    handed_lags: Counter[int] = Counter()
    learner_version = 0
    lost_trained = 0  # trained before a checkpoint, carried by the resumed counters
    # Resume re-dispatches a group whole, while its members that already ended stay counted.
    ended_before_resume = 0

    def check():
        c = core.check_conservation()
        assert c["dispatched"] == group_size * c["groups_started"] + ended_before_resume
        # Admission control: never more groups ahead of the learner than (version + eta + 1) * B.
        assert core.groups_ahead() <= core.admission_limit()
        assert c["trained"] == len(trained) + lost_trained

    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        op = data.draw(st.sampled_from(OPS), label="op")
        slot = data.draw(st.sampled_from(WORKERS), label="worker")
        worker = names[slot]
        if op == "acquire":
            requests = core.acquire(worker, data.draw(st.integers(1, 5)))
            held[slot].extend(requests)
        elif op == "put" and held[slot]:
            order = data.draw(st.permutations(range(len(held[slot]))))
            k = data.draw(st.integers(1, len(order)))
            chosen = [held[slot][j] for j in order[:k]]
            held[slot] = [held[slot][j] for j in order[k:]]
            answers = []
            for r in chosen:
                lag = data.draw(st.integers(0, eta + 1))  # engine weights may be older than the bound
                first = max(0, core.admission_version - lag)
                answers.append(
                    make_answer(
                        r,
                        3,
                        worker=worker,
                        reward=data.draw(st.sampled_from([0.0, 1.0])),
                        # a long sample spans versions: its oldest tokens may outlive the bound, its newest not
                        versions=[first, min(first + 1, core.admission_version), core.admission_version],
                        finish_reason=data.draw(st.sampled_from(["stop", "stop", "length"])),
                        failure=data.draw(st.sampled_from([None, None, None, "timeout", "reward_error: x", "stale: aborted"])),
                    )
                )
            # A live worker's answers are always accepted, even for a group already dropped as a straggler.
            assert core.put(answers) == len(answers)
        elif op == "late_put" and abandoned:
            request, old_worker = abandoned.pop(data.draw(st.integers(0, len(abandoned) - 1)))
            before = core.counters()
            assert core.put([make_answer(request, worker=old_worker)]) == 0
            after = core.counters()
            assert after["stale_attempt"] == before["stale_attempt"] + 1
            assert {k: v for k, v in after.items() if k != "stale_attempt"} == {k: v for k, v in before.items() if k != "stale_attempt"}
        elif op == "requeue":
            abandoned.extend((r, worker) for r in held[slot])
            held[slot] = []
            core.requeue_worker(worker)
            names[slot] = f"{slot}.{len(abandoned)}"
        elif op == "tick":
            clock.advance(data.draw(st.sampled_from([0.5, 3.0, TIMEOUT_S])))
            core.expire_stragglers()
        elif op == "bump":
            core.set_version(core.admission_version + 1)
        elif op == "get":
            # The learner's version never goes back and runs at most one version ahead of the last confirmed sync.
            learner_version = max(learner_version, core.admission_version + data.draw(st.integers(0, 1)))
            batch = core.get_batch(batch_groups, learner_version, min_groups=data.draw(st.sampled_from([None, 1])))
            if batch is not None:
                assert batch.version == learner_version
                assert batch.lags == [learner_version - t.min_version for g in batch.groups for t in g.trajectories]
            for group in batch.groups if batch is not None else []:
                assert group.trajectories and len({t.group_id for t in group.trajectories}) == 1
                for t in group.trajectories:
                    lag = learner_version - t.min_version
                    assert lag <= eta, f"handed out a sample with lag {lag} > eta {eta}"
                    trained_lags = learner_version - t.versions[t.loss_mask != 0]
                    assert len(trained_lags) and trained_lags.max() <= eta, f"a trained token has lag > eta {eta}"
                    assert (t.group_id, t.sample_index) not in trained, "a sample was trained twice"
                    trained.add((t.group_id, t.sample_index))
                    handed_lags[lag] += 1
        elif op == "add":
            core.add_prompts(make_prompts(data.draw(st.integers(1, 4)), prefix="q"), group_size)
        elif op == "checkpoint":
            state = core.state_dict()
            lost_trained += len(trained)
            trained.clear()
            core = ReplayQueueCore(config, batch_groups=batch_groups, clock=clock)
            core.load_state_dict(state)
            ended_before_resume = core.counters()["dispatched"] - group_size * core.counters()["groups_started"]
            assert core.counters()["in_flight"] == 0
            for w in WORKERS:  # the old workers' answers now belong to a previous life of the queue
                abandoned.extend((r, names[w]) for r in held[w])
                held[w] = []
        check()

    assert all(lag <= eta for lag in core.staleness_histogram())
    if not lost_trained:
        assert core.staleness_histogram() == dict(sorted(handed_lags.items()))
    end_everything_in_flight(core)
    c = check() or core.counters()
    assert c["in_flight"] == 0
    assert c["dispatched"] == c["trained"] + c["dropped_stale"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))


def end_everything_in_flight(core: ReplayQueueCore) -> None:
    """Bring every in-flight sample to a terminal state through the queue's own calls: every holder is lost,
    each request still open is answered as failed, and the ready groups meet a learner step far past the bound."""
    for worker in list(core.outstanding_by_worker()):
        core.requeue_worker(worker)
    while requests := core.acquire("closing", 1000):
        core.put([make_answer(r, worker="closing", failure="timeout") for r in requests])
    core.get_batch(1, learner_version=10**9, min_groups=1)
