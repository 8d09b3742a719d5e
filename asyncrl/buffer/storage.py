"""Arrow record batches of trajectories and the append-only Parquet log of every trajectory's fate.

One row per trajectory; per-token arrays are Arrow list columns with the dtypes of `Trajectory`
(int32 ids and versions, float32 log-probs, int8 loss mask), so `trajectories_from_arrow(
trajectories_to_arrow(ts))` gives back equal records, arrays included.

Episode columns (`turn_starts`, `truncated`, `tool_calls`, and the derived `num_turns`, `turn_versions` and
`version_span` for readers of the log) come last; files written before they existed still read, with single-turn
defaults.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.remote import Store, is_remote, join, staging
from asyncrl.types import Trajectory

_TOKEN_COLUMNS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int32),
    "response_ids": np.dtype(np.int32),
    "rollout_logprobs": np.dtype(np.float32),
    "loss_mask": np.dtype(np.int8),
    "versions": np.dtype(np.int32),
}

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("versions", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("ground_truth", pa.string()),
        ("reward", pa.float64()),
        ("failure", pa.string()),
        ("worker", pa.string()),
        ("attempt", pa.int64()),
        ("dispatch_version", pa.int64()),
        ("submitted_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("response_text", pa.string()),
        ("turn_starts", pa.list_(pa.int32())),
        ("truncated", pa.bool_()),
        ("tool_calls", pa.int32()),
        ("num_turns", pa.int32()),
        ("turn_versions", pa.list_(pa.int32())),
        ("version_span", pa.int32()),
    ]
)
_DERIVED = ("num_turns", "turn_versions", "version_span")
"""Written for readers of the log, recomputed from the record when read back."""
_EPISODE_DEFAULTS = {"turn_starts": [0], "truncated": False, "tool_calls": 0}

LOG_SCHEMA = TRAJECTORY_SCHEMA.append(pa.field("fate", pa.string()))
"""The Parquet log: a trajectory plus its terminal state (`trained`, `filtered:zero_variance`, ...)."""

_SCALAR_COLUMNS = [f.name for f in TRAJECTORY_SCHEMA if f.name not in _TOKEN_COLUMNS and f.name not in _DERIVED]


def _list_column(arrays: Sequence[np.ndarray], dtype: np.dtype) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([np.asarray(a) for a in arrays]).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))


def trajectories_to_arrow(trajectories: Sequence[Trajectory], fates: Sequence[str] | None = None) -> pa.RecordBatch:
    """One row per trajectory; with `fates`, adds the `fate` column of the log schema."""
    columns: dict[str, pa.Array] = {}
    for field in TRAJECTORY_SCHEMA:
        name = field.name
        if name in _TOKEN_COLUMNS:
            columns[name] = _list_column([getattr(t, name) for t in trajectories], _TOKEN_COLUMNS[name])
        else:
            columns[name] = pa.array([getattr(t, name) for t in trajectories], field.type)
    schema = TRAJECTORY_SCHEMA
    if fates is not None:
        if len(fates) != len(trajectories):
            raise ValueError(f"{len(fates)} fates for {len(trajectories)} trajectories")
        columns["fate"] = pa.array(list(fates), pa.string())
        schema = LOG_SCHEMA
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)


def _split_list_column(column: pa.ListArray, dtype: np.dtype) -> list[np.ndarray]:
    # `offsets` index into the unsliced child `values`, so this is also right for sliced batches.
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=True)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def trajectories_from_arrow(data: pa.RecordBatch | pa.Table) -> list[Trajectory]:
    """Inverse of `trajectories_to_arrow`; extra columns (such as `fate`) are ignored."""
    batches: Iterable[pa.RecordBatch] = data.to_batches() if isinstance(data, pa.Table) else [data]
    out: list[Trajectory] = []
    for batch in batches:
        tokens = {name: _split_list_column(batch.column(name), dtype) for name, dtype in _TOKEN_COLUMNS.items()}
        scalars = {name: _column_or_default(batch, name) for name in _SCALAR_COLUMNS}
        for i in range(batch.num_rows):
            fields: dict[str, Any] = {name: values[i] for name, values in scalars.items()}
            fields.update({name: arrays[i] for name, arrays in tokens.items()})
            out.append(Trajectory(**fields))
    return out


def _column_or_default(batch: pa.RecordBatch, name: str) -> list:
    if name in batch.schema.names:
        return batch.column(name).to_pylist()
    default = _EPISODE_DEFAULTS[name]  # a log written before episodes existed
    return [list(default) if isinstance(default, list) else default for _ in range(batch.num_rows)]


def next_log_path(output_dir: str | Path, store: Store | None = None) -> tuple[Path, str | None]:
    """-> (`<output_dir>/trajectories.parquet`, or `trajectories.<n>.parquet` when a resumed run finds it taken;
    where it is uploaded). `output_dir` may be an object-store URI: the log is written in this node's staging copy
    of it and uploaded to the URI."""
    remote = is_remote(output_dir)
    folder = staging(str(output_dir)) if remote else Path(output_dir)
    taken = set((store or Store()).listdir(str(output_dir))) if remote else set()
    name, n = "trajectories.parquet", 1
    while (folder / name).exists() or name in taken:
        name, n = f"trajectories.{n}.parquet", n + 1
    return folder / name, join(str(output_dir), name) if remote else None


class TrajectoryLog:
    """Append-only Parquet log of trajectories with their fate, written in row groups of `rows_per_chunk`.

    Parquet files cannot be appended to once closed: a resumed run gets the next free name
    (`next_log_path`). Rows buffered in memory are written by `flush()` and `close()`; with `upload_to` (an
    object-store URI) `close()` uploads the finished file there (`store` reaches it).
    """

    def __init__(
        self, path: str | Path, upload_to: str | None = None, rows_per_chunk: int = 4096, store: Store | None = None
    ) -> None:
        self.path = Path(path)
        self.upload_to, self.store = upload_to, store
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows_per_chunk = rows_per_chunk
        self.rows_written = 0
        self._trajectories: list[Trajectory] = []
        self._fates: list[str] = []
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.path, LOG_SCHEMA)

    def append(self, trajectory: Trajectory, fate: str) -> None:
        if self._writer is None:
            raise RuntimeError(f"trajectory log {self.path} is closed")
        self._trajectories.append(trajectory)
        self._fates.append(fate)
        if len(self._trajectories) >= self.rows_per_chunk:
            self.flush()

    def flush(self) -> None:
        if self._writer is None or not self._trajectories:
            return
        self._writer.write_batch(trajectories_to_arrow(self._trajectories, self._fates))
        self.rows_written += len(self._trajectories)
        self._trajectories, self._fates = [], []

    def close(self) -> None:
        if self._writer is None:
            return
        self.flush()
        self._writer.close()
        self._writer = None
        if self.upload_to is not None:
            (self.store or Store()).upload(self.path, self.upload_to)
