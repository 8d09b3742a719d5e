"""TensorBoard and W&B (offline) sinks: the scalars they write are read back from their own files."""

import json
import time
import struct

from asyncrl.telemetry.loggers import TensorBoardSink, WandbSink, step_scalars
from asyncrl.telemetry.sinks import PoolSnapshot, SyncEvent, Telemetry

ROWS = [{"step": s, "version": s, "reward": 0.25 * s, "loss": float("nan") if s == 2 else 0.5, "lag_counts": {"0": 4, "1": s}, "wall_s": 1.0 * s}
        for s in (1, 2, 3)]  # fmt: skip
SNAPSHOT = PoolSnapshot(wall_s=4.0, version=3, counters={}, queue={"ready_groups": 2}, engines={}, tokens_trained=20, learner_wait_s=1.0)


def _feed(sink) -> None:
    telemetry = Telemetry([sink])
    telemetry.eval({"version": 0, "step": 0, "accuracy": 0.125, "samples_trained": 0})
    telemetry.step(ROWS[0])
    telemetry.eval({"version": 2, "step": 2, "accuracy": 0.5, "samples_trained": 8})  # before the row of step 2
    telemetry.step(ROWS[1])
    telemetry.step(ROWS[2])
    telemetry.sync(SyncEvent(version=3, seconds=0.75))
    telemetry.pool(SNAPSHOT)
    telemetry.close({"steps": 3})
    assert telemetry.sinks == [sink]  # it did not raise


def test_step_scalars_keep_finite_numbers_and_split_the_lag_counts():
    assert step_scalars(ROWS[1]) == {"train/step": 2.0, "train/version": 2.0, "train/reward": 0.5, "train/wall_s": 2.0, "train/lag=0": 4.0, "train/lag=1": 2.0}


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _feed(TensorBoardSink(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (3, 0.5)]  # NaN left out
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.125), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("sync/seconds")] == [(3, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("pool/learner_idle_fraction")] == [(3, 0.25)]  # 1 s of 4, at the last step


def _wandb_records(path):
    """Records of a W&B run file: a LevelDB-style log (7-byte header, then 32 KiB blocks of chunks, each with
    a 7-byte header: crc32, little-endian length, type 1 full / 2 first / 3 middle / 4 last) of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_file, wait_s: float = 15.0) -> list[dict]:
    """The run file's history rows. W&B's service process may still be writing them for a moment after
    `finish()` returns (seen once in a few runs): read again until the rows stop growing, at most `wait_s`."""
    deadline, history = time.monotonic() + wait_s, []
    while True:
        rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item} for r in _wandb_records(run_file) if r.HasField("history")]
        if (rows and len(rows) == len(history)) or time.monotonic() > deadline:
            return rows
        history = rows
        time.sleep(0.5)


def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _feed(WandbSink("asyncrl-test", "offline", tmp_path, "run-1", {"mode": "streaming"}))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [h["train/reward"] for h in history if "train/reward" in h] == [0.25, 0.5, 0.75]
    assert [(h["eval/step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h] == [(0, 0.125), (2, 0.5)]
    assert [h["sync/seconds"] for h in history if "sync/seconds" in h] == [0.75]
    assert [h["pool/rollout_tokens_per_s"] for h in history if "pool/rollout_tokens_per_s" in h] == [0.0]
    assert [h["pool/learner_tokens_per_s"] for h in history if "pool/learner_tokens_per_s" in h] == [5.0]  # 20 tokens / 4 s
