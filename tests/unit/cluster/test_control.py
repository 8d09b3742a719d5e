"""The control API's sizes: what `asyncrl scale` parses, what the control keeps, and the learner resize timings
the summary derives from the pool events."""

import pytest

from asyncrl.cluster.control import Control, LocalControl, Wanted, parse_sizes, sizes_argument
from asyncrl.controller.faults import learner_scaling_timings


def test_scale_arguments_name_either_pool_and_round_trip_to_the_scale_jobs_command_line():
    assert parse_sizes(["rollout=3", "learner=2"]) == {"rollout": 3, "learner": 2}
    assert sizes_argument({"rollout": 3, "learner": 2}) == "rollout=3 learner=2"
    for bad in ("critic=2", "learner=0", "learner=two", "rollout"):
        with pytest.raises(ValueError, match=f"cannot scale '{bad}': use rollout=N and/or learner=N"):
            parse_sizes([bad])


def test_each_pool_keeps_its_own_size_and_request_time():
    control = Control()
    assert control.wanted() == Wanted()
    control.set_size("learner", 2)
    first = control.wanted()
    assert (first.rollout, first.learner, first.rollout_at) == (None, 2, None) and first.learner_at is not None
    control.set_size("rollout", 4)
    assert control.wanted().learner_at == first.learner_at and control.wanted().rollout == 4
    for pool, size, message in [("learner", 0, "learner pool size must be an integer >= 1"),
                                ("learner", True, "integer"), ("actor", 1, "cannot scale pool 'actor'")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            control.set_size(pool, size)
    local = LocalControl()
    assert local.set_size("learner", 3) == 3 and local.poll().learner == 3


def test_learner_scaling_pairs_each_resize_with_the_next_first_step_on_the_new_pool():
    events = [
        {"kind": "joined", "worker": "rollout-1", "wall": 90.0},
        {"kind": "learner_resized", "worker": "learner", "from_ranks": 1, "ranks": 2, "step": 4, "version": 4,
         "requested_at": 100.0, "checkpoint_s": 1.5, "reform_s": 9.0, "wall": 110.5},
        {"kind": "learner_first_step", "worker": "learner", "ranks": 2, "wall": 113.25},
        {"kind": "learner_resize_refused", "worker": "learner", "from_ranks": 2, "ranks": 2, "wall": 120.0},
        {"kind": "learner_resized", "worker": "learner", "from_ranks": 2, "ranks": 1, "step": 9, "version": 9,
         "requested_at": 130.0, "checkpoint_s": 1.0, "reform_s": 5.0, "wall": 136.0},
    ]  # fmt: skip
    assert learner_scaling_timings(events) == [
        {"from_ranks": 1, "ranks": 2, "step": 4, "version": 4, "checkpoint_s": 1.5, "reform_s": 9.0,
         "request_to_first_step_s": 13.25},
        {"from_ranks": 2, "ranks": 1, "step": 9, "version": 9, "checkpoint_s": 1.0, "reform_s": 5.0,
         "request_to_first_step_s": None},  # the run ended before a step on the new pool
    ]  # fmt: skip
