"""The wire forms of `types`: `PackedTrajectories` and `Batch` cross a pickle (as Ray sends them) unchanged."""

import dataclasses
import pickle

import numpy as np

from asyncrl.testing import make_group, make_prompt, make_trajectory
from asyncrl.types import Batch, Exchange, Group, PackedTrajectories, Request, Trajectory, TrajectoryColumns


def over_the_wire(obj):
    """Pickle as Ray does (protocol 5, numpy arrays out of band); returns the copy and the buffer count."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers), len(buffers)


def assert_same_trajectory(got: Trajectory, want: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), f.name
        else:
            assert a == b, f.name


def varied_trajectories() -> list[Trajectory]:
    """Every field differs between the three, lengths included (one response is empty)."""
    return [
        make_trajectory(3, prompt_ids=[7, 8], group_id="g0", sample_index=0, versions=[4, 5, 5], rollout_logprobs=[-0.5, -1.0, -2.0],
                        loss_mask=[1, 0, 1], reward=1.0, worker="w0", attempt=2, finish_reason="length", turn_starts=[0, 2],
                        truncated=True, tool_calls=1, response_text="abc", submitted_at=1.5, finished_at=2.5),
        make_trajectory(0, prompt_ids=[9], group_id="g0", sample_index=1, dispatch_version=6, failure="timeout", attempt=None),
        make_trajectory([11, 12], prompt_ids=[1, 2, 3, 4], group_id="g1", prompt_id="p1", sample_index=3, versions=7,
                        ground_truth="42", reward=-0.25, worker="w1", attempt=0),
    ]  # fmt: skip


def test_packed_trajectories_cross_a_pickle_with_every_field_and_dtype():
    sent = varied_trajectories()
    received, buffers = over_the_wire(PackedTrajectories(sent))
    assert len(received) == 3
    for got, want in zip(received, sent):
        assert_same_trajectory(got, want)
    # One buffer per array field (prompt_ids + 4 per-token columns), however many trajectories.
    assert buffers == 5
    assert [t.min_version for t in received] == [4, 6, 7]  # token versions [4, 5, 5]; empty -> dispatch 6; all 7


def test_packed_trajectories_slice_and_index_like_the_list():
    sent = varied_trajectories()
    received, _ = over_the_wire(PackedTrajectories(sent))
    assert [t.sample_index for t in received[1:]] == [1, 3]
    assert received[-1].group_id == "g1"
    assert over_the_wire(PackedTrajectories([]))[0][:] == []


def test_a_batch_crosses_a_pickle_with_its_groups_and_lags():
    groups = [make_group([1.0, 0.0], group_id="a", versions=3), Group("b", [make_trajectory(2, group_id="b", versions=[1, 2])])]
    received, buffers = over_the_wire(Batch(groups, version=4))
    assert buffers == 5
    assert [g.group_id for g in received.groups] == ["a", "b"]
    assert received.version == 4
    assert received.lags == [1, 1, 3]  # 4 - 3 for both members of a; 4 - min(1, 2) for b
    for got, want in zip(received.groups, groups):
        for a, b in zip(got.trajectories, want.trajectories):
            assert_same_trajectory(a, b)


def test_a_received_batch_has_its_lags_before_its_groups_are_built_and_passes_on_as_it_came():
    groups = [Group("g0", varied_trajectories()[:2]), Group("g1", varied_trajectories()[2:])]
    received, _ = over_the_wire(Batch(groups, version=9))
    assert "groups" not in vars(received)  # no Trajectory built yet
    # 9 - min(4, 5, 5); 9 - dispatch_version 6 (no tokens); 9 - 7
    assert (received.lags, received.num_samples, received.staleness_max) == ([5, 3, 2], 3, 5)
    again, buffers = over_the_wire(received)
    assert buffers == 5 and "groups" not in vars(received)  # sent on from the columns it came in
    assert again.lags == [5, 3, 2] and [len(g.trajectories) for g in again.groups] == [2, 1]
    for got, want in zip(again.groups[0].trajectories + again.groups[1].trajectories, varied_trajectories()):
        assert_same_trajectory(got, want)
    assert [g.group_id for g in received.groups] == ["g0", "g1"] and "groups" in vars(received)  # built on first read


def test_min_versions_of_columns_match_each_trajectorys_min_version():
    sent = varied_trajectories() + [make_trajectory(0, dispatch_version=2), make_trajectory(4, versions=[9, 3, 8, 3])]
    columns = TrajectoryColumns.pack(sent)
    assert columns.min_versions().tolist() == [t.min_version for t in sent] == [4, 6, 7, 2, 3]
    assert TrajectoryColumns.pack([]).min_versions().tolist() == []


def test_an_exchange_crosses_a_pickle_with_equal_requests_and_shared_prompts():
    prompt = make_prompt("p0", [1, 2, 3], "6")
    requests = [Request(f"p0#0/{i}/{i % 2}", "p0#0", i, 2, prompt, attempt=i % 2) for i in range(2)]
    received, _ = over_the_wire(Exchange(3, requests))
    assert received == Exchange(3, requests)
    assert received.requests[0].prompt is received.requests[1].prompt  # one prompt per group on the wire
