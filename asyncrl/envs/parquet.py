"""Streamed verl-layout Parquet datasets: files, folders and globs read row group by row group, shuffled per epoch,
tokenized one prompt at a time (docs/data.md).

What stays resident: the row-group index (file, row count and first row of each row group: three small integer
arrays), the epoch's order (one int64 per row), and the Arrow tables of the row groups of the current shuffle
window. Prompt ids are read once to reject duplicates, then dropped; prompts are tokenized as they are drawn.

`resolve_files` and `open_parquet` are the only places that touch the file system.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.types import Prompt

VERL_COLUMNS = ("data_source", "prompt", "reward_model")
"""The columns every verl-layout file has (`extra_info` is optional; its `index` is the prompt id)."""


def resolve_files(spec: str) -> list[str]:
    """The Parquet files of a `data.train_path`/`eval_path`: a file, a folder (its `*.parquet` files, recursively)
    or a glob (`data/*.parquet`, `data/**/train-*.parquet`); sorted by path, so the order is deterministic."""
    if glob.has_magic(spec):
        files = sorted(f for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"no file matches the pattern {spec}")
        return files
    path = Path(spec)
    if path.is_dir():
        files = sorted(str(f) for f in path.rglob("*.parquet") if f.is_file())
        if not files:
            raise FileNotFoundError(f"{spec} is a folder without *.parquet files")
        return files
    if not path.exists():
        raise FileNotFoundError(f"{spec} does not exist")
    return [spec]


def open_parquet(path: str) -> Any:
    """The `pyarrow.parquet.ParquetFile` of a path, its verl columns checked; ValueError naming the file if it is
    not Parquet or lacks a column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path} is not a readable Parquet file: {e}") from None
    names = file.schema_arrow.names
    missing = [c for c in VERL_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path} lacks the verl columns {missing} (has {names})")
    return file


def _has_index(file: Any) -> bool:
    import pyarrow as pa

    schema = file.schema_arrow
    if "extra_info" not in schema.names:
        return False
    kind = schema.field("extra_info").type
    return pa.types.is_struct(kind) and kind.get_field_index("index") >= 0


@dataclass(frozen=True)
class Location:
    """A dataset row's place: its row group's number across the dataset (`key`), its file, the row group's number
    in the file, its row in the row group and in the file."""

    key: int
    path: str
    group: int
    in_group: int
    in_file: int

    def describe(self) -> str:
        return f"{self.path}: row {self.in_file} (row group {self.group})"


@dataclass
class ParquetIndex:
    """Where each row is: the files in order and, per row group (all files' row groups in order), its file, its
    row count and the dataset-wide number of its first row. Rows are numbered across the files in order."""

    spec: str
    files: list[str]
    group_file: np.ndarray
    group_rows: np.ndarray
    group_start: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.group_rows.sum())

    @classmethod
    def build(cls, spec: str) -> ParquetIndex:
        """Read every file's footer and prompt ids (`extra_info.index`, else the row's number); ValueError naming
        the pattern, file, row group or duplicate id at fault."""
        files = resolve_files(spec)
        group_file, group_rows, ids = [], [], []
        for f, path in enumerate(files):
            file = open_parquet(path)
            for g in range(file.num_row_groups):
                group_file.append(f)
                group_rows.append(file.metadata.row_group(g).num_rows)
            ids.append(_file_ids(file, path, sum(group_rows) - file.metadata.num_rows))
        rows = np.asarray(group_rows, dtype=np.int64)
        index = cls(spec, files, np.asarray(group_file, np.int64), rows, np.cumsum(rows) - rows)
        if index.num_rows == 0:
            raise ValueError(f"{spec} has no rows ({len(files)} file(s))")
        index._check_unique(ids)
        return index

    def locate(self, row: int) -> Location:
        """Where dataset row `row` is."""
        g = int(np.searchsorted(self.group_start, row, side="right")) - 1
        f = int(self.group_file[g])
        first_group = int(np.searchsorted(self.group_file, f))
        in_file = row - int(self.group_start[first_group])
        return Location(g, self.files[f], g - first_group, row - int(self.group_start[g]), in_file)

    def where(self, row: int) -> str:
        return self.locate(row).describe()

    def _check_unique(self, ids: list[Any]) -> None:
        """ValueError naming the first repeated id and its first two rows. Integer ids (the usual `extra_info.index`,
        and row numbers) are compared as an int64 array; string ids as an Arrow string array."""
        import pyarrow as pa

        if all(isinstance(part, np.ndarray) for part in ids):
            column = np.concatenate(ids)
        else:
            column = pa.chunked_array([pa.array(p.astype(str)) if isinstance(p, np.ndarray) else p for p in ids])
            column = column.to_numpy(zero_copy_only=False)  # objects: a tiebreak-free sort below names the rows
        order = np.argsort(column, kind="stable")
        ordered = column[order]
        repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
        pa.default_memory_pool().release_unused()  # the id columns were read through Arrow's pool
        if repeats.size:
            at = repeats[0]
            prompt_id, first, second = str(ordered[at]), int(order[at]), int(order[at + 1])
            distinct = len(np.unique(ordered[1:][repeats]))
            raise ValueError(
                f"{self.spec}: duplicate prompt id {prompt_id!r} (extra_info.index) at {self.where(first)} "
                f"and at {self.where(second)}; {distinct} id(s) repeat. Prompt ids key per-prompt state "
                "(the pass-rate curriculum): make extra_info.index unique, or drop the column to number rows"
            )


def _file_ids(file: Any, path: str, first_row: int) -> Any:
    """The file's prompt ids: `extra_info.index`, or the row's dataset-wide number where it is null or absent;
    an int64 array when they are integers, else an Arrow string array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    numbers = np.arange(first_row, first_row + file.metadata.num_rows, dtype=np.int64)
    if not _has_index(file):
        return numbers
    try:
        table = file.read(columns=["extra_info.index"], use_threads=False)
        column = table.column("extra_info").combine_chunks().field("index")
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged column
        raise ValueError(f"{path}: cannot read column extra_info.index: {e}") from None
    if pa.types.is_integer(column.type):
        return pc.coalesce(pc.cast(column, pa.int64()), pa.array(numbers)).to_numpy()
    return pc.coalesce(pc.cast(column, pa.string()), pa.array(numbers.astype(str)))


def check_verl_row(row: dict[str, Any], where: str) -> None:
    """Raise naming the row (`where`: file and row) unless it has the nested verl layout."""
    prompt = row["prompt"]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
    ):
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages")
    _check_text(prompt, where)
    if not isinstance(row["reward_model"], dict) or row["reward_model"].get("ground_truth") is None:
        raise ValueError(f"{where}: reward_model.ground_truth is missing")


def _check_text(messages: list[dict[str, Any]], where: str) -> None:
    """Each message's content is UTF-8 text, and the prompt has some."""
    for m, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, bytes):
            try:
                content.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: prompt message {m} is not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
        if not isinstance(content, str):
            raise ValueError(f"{where}: prompt message {m} content must be a string (got {type(content).__name__})")
    if not any(message["content"].strip() for message in messages):
        raise ValueError(f"{where}: the prompt is empty (every message's content is blank)")


def epoch_order(index: ParquetIndex, seed: int, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of one epoch in the order they are drawn, and the row count of each window (its row groups are
    resident together). `window` > 0: the row groups in a random order (seeded by `seed` and `epoch`), cut into
    windows of `window` row groups whose rows are shuffled together; 0: file order, one row group at a time."""
    if window <= 0:
        return np.arange(index.num_rows, dtype=np.int64), index.group_rows.copy()
    rng = np.random.default_rng([seed, epoch])
    groups = rng.permutation(len(index.group_rows))
    starts, counts = index.group_start, index.group_rows
    parts, sizes = [], []
    for at in range(0, len(groups), window):
        rows = np.concatenate([np.arange(starts[g], starts[g] + counts[g]) for g in groups[at : at + window]])
        rng.shuffle(rows)
        parts.append(rows)
        sizes.append(len(rows))
    return np.concatenate(parts), np.asarray(sizes, np.int64)


class ParquetPrompts(Iterator[Prompt]):
    """The endless, shuffled prompt stream of a Parquet dataset. Its position (`state_dict`: epoch, rows of the
    epoch read, prompts dropped) goes into checkpoints; `load_state_dict` resumes at the same row. Prompts longer
    than `max_prompt_tokens` are skipped and counted (`dropped`)."""

    def __init__(self, index: ParquetIndex, encode: Any, seed: int, window: int, max_prompt_tokens: int) -> None:
        self.index, self.encode, self.seed, self.window = index, encode, seed, window
        self.max_prompt_tokens = max_prompt_tokens
        self.epoch = self.cursor = self.dropped = self.kept_in_epoch = 0
        self._order, self._window_ends = self._epoch(0)
        self._tables: dict[int, Any] = {}
        self._window = -1

    def fresh(self) -> ParquetPrompts:
        """A stream at the start of epoch 0 sharing this one's index."""
        return ParquetPrompts(self.index, self.encode, self.seed, self.window, self.max_prompt_tokens)

    def __next__(self) -> Prompt:
        while True:
            if self.cursor == len(self._order):
                self._next_epoch()
            row = int(self._order[self.cursor])
            prompt = self._prompt(row)
            self.cursor += 1
            if len(prompt.prompt_ids) <= self.max_prompt_tokens:
                self.kept_in_epoch += 1
                return prompt
            self.dropped += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "prompts_dropped": self.dropped,
            "kept_in_epoch": self.kept_in_epoch,
            "rows": self.index.num_rows,
            "files": len(self.index.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows, files = self.index.num_rows, len(self.index.files)
        if (state["rows"], state["files"]) != (rows, files):
            raise ValueError(
                f"{self.index.spec}: the checkpoint's data position is for {state['rows']} rows in {state['files']} "
                f"file(s); the dataset now has {rows} rows in {files}: resuming would not continue the same epoch"
            )
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.dropped, self.kept_in_epoch = state["prompts_dropped"], state["kept_in_epoch"]
        self._order, self._window_ends = self._epoch(self.epoch)
        self._tables, self._window = {}, -1

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order, sizes = epoch_order(self.index, self.seed, epoch, self.window)
        return order, np.cumsum(sizes)

    def _next_epoch(self) -> None:
        if not self.kept_in_epoch:
            raise ValueError(
                f"{self.index.spec}: every one of its {self.index.num_rows} prompts is longer than "
                f"data.max_prompt_tokens ({self.max_prompt_tokens} tokens)"
            )
        self.epoch, self.cursor, self.kept_in_epoch = self.epoch + 1, 0, 0
        self._order, self._window_ends = self._epoch(self.epoch)
        self._tables, self._window = {}, -1

    def _prompt(self, row: int) -> Prompt:
        """The prompt of dataset row `row`, its row group read (and kept while its window lasts) if need be."""
        window = int(np.searchsorted(self._window_ends, self.cursor, side="right"))
        if window != self._window:
            self._tables, self._window = {}, window  # the previous window's row groups are done with
        at = self.index.locate(row)
        if at.key not in self._tables:
            self._tables[at.key] = _read_group(at.path, at.group)
        values = self._tables[at.key].slice(at.in_group, 1).to_pylist()[0]
        return self._to_prompt(values, row, at.describe())

    def _to_prompt(self, values: dict[str, Any], row: int, where: str) -> Prompt:
        check_verl_row(values, where)
        extra = dict(values.get("extra_info") or {})
        index = extra.get("index")
        return Prompt(
            prompt_id=str(row if index is None else index),
            prompt_ids=self.encode(values["prompt"]),
            ground_truth=str(values["reward_model"]["ground_truth"]),
            text=values["prompt"][-1]["content"],
            data_source=values["data_source"],
            extra_info=extra,
        )


def _read_group(path: str, group: int) -> Any:
    file = open_parquet(path)
    columns = [c for c in (*VERL_COLUMNS, "extra_info") if c in file.schema_arrow.names]
    try:
        return file.read_row_group(group, columns=columns)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged row group
        raise ValueError(f"{path}: cannot read row group {group}: {e}") from None
