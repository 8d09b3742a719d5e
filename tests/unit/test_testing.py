"""The record builders of `asyncrl.testing`: defaults that hold each record's invariant, and overrides."""

import numpy as np
import pytest

from asyncrl.testing import make_answer, make_group, make_prompt, make_request, make_trajectory, ray_node_ports


def test_a_default_trajectory_has_three_tokens_of_version_zero_from_group_g0():
    t = make_trajectory()
    assert t.group_id == t.prompt_id == "g0" and t.sample_index == 0
    assert t.prompt_ids.tolist() == [1, 2, 3] and t.response_ids.tolist() == [0, 1, 2]
    assert t.rollout_logprobs.tolist() == [-1.0, -1.0, -1.0] and t.loss_mask.tolist() == [1, 1, 1]
    assert t.versions.tolist() == [0, 0, 0] and t.dispatch_version == 0
    assert (t.prompt_ids.dtype, t.response_ids.dtype, t.rollout_logprobs.dtype, t.loss_mask.dtype, t.versions.dtype) == (
        np.int32, np.int32, np.float32, np.int8, np.int32,
    )  # fmt: skip
    assert t.num_tokens == 6  # 3 prompt + 3 response


def test_per_token_values_are_taken_as_given_and_dispatch_version_is_the_oldest_token():
    t = make_trajectory([7, 8], rollout_logprobs=[-0.5, -2.0], loss_mask=[1, 0], versions=[3, 2], reward=1.0, worker="w1")
    assert t.response_ids.tolist() == [7, 8] and t.loss_mask.tolist() == [1, 0]
    assert t.rollout_logprobs.tolist() == [-0.5, -2.0]
    assert t.dispatch_version == 2  # min(3, 2)
    assert (t.min_version, t.max_version, t.reward, t.worker) == (3, 3, 1.0, "w1")  # the lag counts trained tokens only
    assert make_trajectory(0).dispatch_version == 0  # an empty response has no oldest token


def test_a_trajectory_whose_arrays_disagree_is_refused():
    with pytest.raises(ValueError, match="differ in length"):
        make_trajectory(3, versions=[0, 1])


def test_a_request_is_named_group_sample_attempt_after_its_prompt():
    prompt = make_prompt("p5", [1, 4], "12", extra_info={"max_tokens": 9})
    assert (prompt.prompt_ids, prompt.ground_truth, prompt.extra_info) == ([1, 4], "12", {"max_tokens": 9})
    r = make_request(prompt, sample_index=2, group_size=4, attempt=1)
    assert (r.request_id, r.group_id, r.sample_index, r.group_size, r.attempt) == ("p5/2/1", "p5", 2, 4, 1)
    assert make_request(prompt, group_id="g5").request_id == "g5/0/0"


def test_an_answer_carries_its_request_identity_unless_overridden():
    request = make_request(make_prompt("p1", [5, 6], "7"), group_id="g1", sample_index=1, attempt=2)
    t = make_answer(request, 4, versions=5)
    assert (t.prompt_id, t.group_id, t.sample_index, t.ground_truth, t.attempt) == ("p1", "g1", 1, "7", 2)
    assert t.prompt_ids.tolist() == [5, 6] and len(t.response_ids) == 4 and t.dispatch_version == 5
    assert make_answer(request, attempt=None).attempt is None


def test_a_group_numbers_its_members_and_gives_each_its_reward():
    g = make_group([1.0, 0.0, 0.5], group_id="a", versions=1)
    assert g.group_id == "a" and [t.sample_index for t in g.trajectories] == [0, 1, 2]
    assert g.rewards == [1.0, 0.0, 0.5] and g.min_version == 1
    assert g.num_tokens == 18  # 3 members x (3 prompt + 3 response)


def test_a_ray_node_gets_six_port_flags_of_its_own():
    flags = ray_node_ports()
    names, ports = zip(*(flag.split("=") for flag in flags))
    assert len(set(names)) == 6 and "--dashboard-agent-listen-port" in names
    assert len(set(ports)) == 6 and all(int(p) > 0 for p in ports)
