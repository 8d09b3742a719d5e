"""The wire forms of `types`: `PackedTrajectories` and `Batch` cross a pickle (as Ray sends them) unchanged."""

import dataclasses
import pickle

import numpy as np

from asyncrl.testing import make_group, make_trajectory
from asyncrl.types import Batch, Group, PackedTrajectories, Trajectory


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
