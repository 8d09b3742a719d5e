"""Arrow round trip of trajectories and the Parquet fate log."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from buffer_fakes import FakeClock, make_config, make_prompts

from asyncrl.buffer.core import ReplayQueueCore
from asyncrl.buffer.storage import TrajectoryLog, next_log_path, trajectories_from_arrow, trajectories_to_arrow
from asyncrl.testing import make_answer, make_trajectory
from asyncrl.types import Trajectory


def sample_trajectories() -> list[Trajectory]:
    rng = np.random.default_rng(0)
    out = []
    for k, length in enumerate([5, 0, 1, 17]):
        out.append(
            Trajectory(
                prompt_id=f"p{k}",
                group_id=f"p{k}#{k}",
                sample_index=k,
                prompt_ids=rng.integers(0, 16, size=3 + k).astype(np.int32),
                response_ids=rng.integers(0, 16, size=length).astype(np.int32),
                rollout_logprobs=-rng.random(length).astype(np.float32),  # float32 bits must survive exactly
                loss_mask=(rng.random(length) > 0.3).astype(np.int8),
                versions=rng.integers(0, 9, size=length).astype(np.int32),
                finish_reason=["stop", "length", "abort", "error"][k],
                ground_truth=str(k * 7),
                reward=[1.0, 0.0, 0.25, -1.5][k],
                failure=[None, "timeout", None, "reward_error: x: y"][k],
                worker=f"w{k}",
                dispatch_version=k + 2,
                submitted_at=1000.0 + k / 3,
                finished_at=1001.0 + k / 7,
                response_text="ünïcode" if k == 3 else "",
            )
        )
    return out


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert np.array_equal(x, y), name
    for name in ("prompt_id", "group_id", "sample_index", "finish_reason", "ground_truth", "reward", "failure", "worker",
                 "dispatch_version", "submitted_at", "finished_at", "response_text"):
        assert getattr(a, name) == getattr(b, name), name


def test_trajectories_round_trip_through_arrow_losslessly():
    trajectories = sample_trajectories()
    batch = trajectories_to_arrow(trajectories)
    assert batch.num_rows == 4 and batch.schema.field("rollout_logprobs").type == pa.list_(pa.float32())
    back = trajectories_from_arrow(batch)
    assert len(back) == 4
    for a, b in zip(trajectories, back):
        assert_same(a, b)
    assert back[1].min_version == 3  # empty response: falls back to dispatch_version


def test_a_sliced_batch_and_a_table_round_trip_too():
    trajectories = sample_trajectories()
    batch = trajectories_to_arrow(trajectories)
    for a, b in zip(trajectories[2:], trajectories_from_arrow(batch.slice(2, 2))):
        assert_same(a, b)
    table = pa.Table.from_batches([batch.slice(0, 2), batch.slice(2, 2)])
    for a, b in zip(trajectories, trajectories_from_arrow(table)):
        assert_same(a, b)


def test_the_log_writes_chunks_and_flushes_the_rest_on_close(tmp_path):
    log = TrajectoryLog(tmp_path / "log.parquet", rows_per_chunk=3)
    trajectories = sample_trajectories()
    for t in trajectories:
        log.append(t, "trained")
    assert log.rows_written == 3
    log.close()
    table = pq.read_table(tmp_path / "log.parquet")
    assert table.num_rows == 4 and table.column("fate").to_pylist() == ["trained"] * 4
    assert pq.ParquetFile(tmp_path / "log.parquet").metadata.num_row_groups == 2
    for a, b in zip(trajectories, trajectories_from_arrow(table)):
        assert_same(a, b)


def test_a_resumed_run_logs_to_the_next_free_file(tmp_path):
    assert next_log_path(tmp_path)[0].name == "trajectories.parquet"
    (tmp_path / "trajectories.parquet").touch()
    assert next_log_path(tmp_path)[0].name == "trajectories.1.parquet"


def test_the_queue_logs_every_arrived_trajectory_with_its_fate(tmp_path):
    clock = FakeClock()
    config = make_config(max_staleness=0, filter_zero_variance=True, filter_overlong=True, log_parquet=True, group_timeout_s=5.0,
                         stale_policy="drop")  # the learner does not wait: every fate shows up
    core = ReplayQueueCore(config, batch_groups=5, clock=clock, log_dir=tmp_path)
    core.add_prompts(make_prompts(5), samples_per_prompt=2)
    trained, zero_var, overlong_failed, stale, straggler = (core.acquire("w0", 2) for _ in range(5))
    core.put([make_answer(r, reward=float(r.sample_index)) for r in trained])
    core.put([make_answer(r, reward=1.0) for r in zero_var])
    core.put([make_answer(overlong_failed[0], reward=1.0, finish_reason="length"), make_answer(overlong_failed[1], failure="timeout")])
    assert [g.group_id for g in core.get_batch(1, learner_version=0).groups] == [trained[0].group_id]
    core.put([make_answer(r, reward=float(r.sample_index), versions=0) for r in stale])
    core.put([make_answer(straggler[0])])
    clock.advance(5.0)
    assert core.get_batch(1, learner_version=1, min_groups=0).groups == []  # lag 1 > eta 0: the ready group is dropped
    core.put([make_answer(straggler[1])])  # late member of the dropped straggler group
    core.close()

    fates = Counter(pq.read_table(tmp_path / "trajectories.parquet").column("fate").to_pylist())
    assert fates == {
        "trained": 2,
        "dropped_stale": 2,
        "filtered:zero_variance": 2,
        "filtered:overlong": 1,
        "failed:timeout": 1,
        "filtered:straggler": 2,
    }
    c = core.check_conservation()
    assert {k: c[k] for k in fates} == dict(fates)


def test_episode_fields_round_trip_and_the_log_shows_turns_and_their_versions(tmp_path):
    # Two model turns (versions 3 then 5) around a 2-token observation, cut by max_turns, one tool call.
    episode = make_trajectory([7, 8, 20, 21, 9], loss_mask=[1, 1, 0, 0, 1], versions=[3, 3, 3, 3, 5],
                              turn_starts=[0, 4], truncated=True, tool_calls=1, finish_reason="max_turns")
    log = TrajectoryLog(tmp_path / "t.parquet")
    log.append(episode, "trained")
    log.close()
    table = pq.read_table(tmp_path / "t.parquet")
    row = table.to_pylist()[0]
    assert (row["turn_starts"], row["turn_versions"], row["num_turns"], row["tool_calls"], row["truncated"]) == ([0, 4], [3, 5], 2, 1, True)
    (back,) = trajectories_from_arrow(table)
    assert (back.turn_starts, back.truncated, back.tool_calls, back.finish_reason) == ([0, 4], True, 1, "max_turns")


def test_a_log_written_before_episodes_existed_still_reads_as_single_turn():
    old_columns = [f.name for f in trajectories_to_arrow([]).schema][:18]  # the schema up to `response_text`
    old = trajectories_to_arrow(sample_trajectories()).select(old_columns)
    back = trajectories_from_arrow(old)
    assert [(t.turn_starts, t.truncated, t.tool_calls) for t in back] == [([0], False, 0)] * 4
    back[0].turn_starts.append(9)
    assert back[1].turn_starts == [0]  # each record its own list
