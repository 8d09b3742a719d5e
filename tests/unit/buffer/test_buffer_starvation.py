"""Starvation: the queue records how each group was resolved, and a starved learner is told why and what to change."""

from buffer_fakes import FakeClock, make_config, make_prompts

from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.buffer.starvation import GroupOutcomes, Starvation, starved_message
from asyncrl.testing import make_answer


def _answer_all(queue: ReplayQueueCore, rewards: list[float], failure: str | None = None) -> None:
    requests = queue.acquire("w0", 100)
    queue.put([make_answer(r, 3, worker="w0", reward=rewards[r.sample_index], failure=failure) for r in requests])


def test_groups_filtered_for_zero_variance_are_counted_since_the_last_ready_group():
    clock = FakeClock()
    queue = ReplayQueueCore(make_config(filter_zero_variance=True), batch_groups=8, clock=clock)
    queue.add_prompts(make_prompts(2), 2)
    _answer_all(queue, [1.0, 0.0])  # 2 groups with a reward spread: both ready
    clock.advance(30.0)
    queue.add_prompts(make_prompts(3, "q"), 2)
    _answer_all(queue, [0.0, 0.0])  # 3 groups whose two rewards are both 0: all filtered
    clock.advance(10.0)

    s = queue.starvation()
    # 5 groups resolved, 2 ready, then 3 filtered 40 s after the queue started, 10 s after the last ready one
    assert (s.groups_resolved, s.groups_ready, s.since_ready) == (5, 2, {"filtered:zero_variance": 3})
    assert s.zero_variance_rewards == (0.0, 0.0) and s.seconds_since_ready == 40.0 - 0.0
    assert s.starved(3) and not s.starved(4)


def test_a_ready_group_ends_the_streak():
    outcomes = GroupOutcomes(now=0.0)
    for t in (1.0, 2.0):
        outcomes.record("filtered:zero_variance", t, reward=0.0)
    outcomes.record("ready", 5.0)
    outcomes.record("failed:reward_error", 6.0)
    s = outcomes.snapshot(now=9.0)
    assert (s.groups_resolved, s.groups_ready, s.since_ready, s.seconds_since_ready) == (4, 1, {"failed:reward_error": 1}, 4.0)
    assert s.zero_variance_rewards is None


def test_a_group_whose_every_sample_failed_counts_under_the_failure_reason():
    queue = ReplayQueueCore(make_config(filter_zero_variance=True), batch_groups=1, clock=FakeClock())
    queue.add_prompts(make_prompts(2), 2)
    _answer_all(queue, [0.0, 0.0], failure="reward_error: division by zero")
    assert queue.starvation().since_ready == {"failed:reward_error": 2}
    assert "every sample failed (failed:reward_error)" in queue.starvation().advice()


def test_the_starved_message_names_the_counts_the_filter_key_and_the_model():
    s = Starvation(groups_resolved=12, groups_ready=0, since_ready={"filtered:zero_variance": 12}, zero_variance_rewards=(0.0, 0.0), seconds_since_ready=95.0)
    message = starved_message(s, waited_s=240.0)
    assert message.startswith(
        "no batch in 240 s: the last 12 groups were all filtered or failed (zero_variance 12; every reward was 0) over 95 s;"
        " 0 of 12 groups ever became ready — the model never solves these prompts"
    )
    for key in ("buffer.filter_zero_variance=false", "model.path", "data.train_path"):
        assert key in message


def test_all_equal_positive_rewards_point_at_the_reward_or_harder_prompts():
    s = Starvation(4, 0, {"filtered:zero_variance": 4}, (1.0, 1.0), 3.0)
    assert "same reward" in s.advice() and "every reward was 1" in s.describe()


def test_mixed_reasons_are_listed_most_frequent_first_and_the_top_one_advises():
    s = Starvation(5, 0, {"filtered:overlong": 1, "filtered:straggler": 4}, None, 3.0)
    assert "(straggler 4, overlong 1)" in s.describe()
    assert "buffer.group_timeout_s" in s.advice()
