"""Parquet at scale: the driver side of a 1,000,000-row, 20-file verl-layout dataset.

Writes the dataset into a temporary folder (20 files of 50,000 rows, row groups of 10,000 rows; a system and a
user message of ~250 characters each, unique `extra_info.index`), then, each in a fresh process so that RSS is the
loader's own, measures what the controller does before and while it trains:

- `stream`: `asyncrl.envs.data.train_stream` (`data.train_path` = the folder, shuffled, `data.max_prompt_tokens` from
  the default context), its first prompt, then `--batches` batches of 64 prompts: time to the index, to the first
  prompt, to the first batch, the rate while drawing, and RSS (resident set size) at each point;
- `whole_file`: the path the stream replaced (one file read with `read_table`, every row checked and tokenized up
  front, then cycled), on the first `--whole-rows` rows written as one file: its time to the first batch and RSS.

The tokenizer is `asyncrl.models.bpe.production_tokenizer("chatml")` (tekken's 131k-token byte-level BPE with a
ChatML template), so tokenizing costs what a real model's tokenizer costs.

    python benchmarks/data_scale.py                  # 1,000,000 rows / 20 files; whole-file path on 100,000 rows
    python benchmarks/data_scale.py --quick          # 100,000 rows / 20 files; whole-file path on 20,000 rows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

BATCH = 64
WORDS = "the of a number sum each total apples train speed hours costs price more than less twice half".split()


def write_dataset(folder: Path, rows: int, files: int, row_group: int) -> float:
    """`rows` prompts in `files` files of row groups of `row_group` rows; returns the seconds it took."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    began, per_file = time.perf_counter(), rows // files
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        index = np.arange(f * per_file, (f + 1) * per_file)
        words = rng.integers(0, len(WORDS), size=(per_file, 40))
        user = [f"Problem {i}: " + " ".join(WORDS[w] for w in ws) + f" {i % 97} + {i % 89} = ?" for i, ws in zip(index, words, strict=True)]
        role = pa.array(["system", "user"] * per_file)
        content = pa.array([x for u in user for x in ("You are a careful solver. Answer with a number only. " * 5, u)])
        messages = pa.StructArray.from_arrays([role, content], names=["role", "content"])
        prompt = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * per_file + 1, 2, dtype=np.int32)), messages)
        reward = pa.StructArray.from_arrays([pa.array(["rule"] * per_file), pa.array((index % 97 + index % 89).astype(str))], names=["style", "ground_truth"])
        extra = pa.StructArray.from_arrays([pa.array(index), pa.array(["train"] * per_file)], names=["index", "split"])
        table = pa.table({"data_source": pa.array(["synthetic"] * per_file), "prompt": prompt, "reward_model": reward, "extra_info": extra})
        pq.write_table(table, folder / f"train-{f:05d}.parquet", row_group_size=row_group)
    return time.perf_counter() - began


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def measure_stream(path: str, batches: int) -> dict:
    """In this process: the new stream's times and RSS (the `stream` child)."""
    from asyncrl.config import Config
    from asyncrl.envs.data import train_stream
    from asyncrl.models.bpe import production_tokenizer

    tokenizer = production_tokenizer("chatml")
    cfg = Config.model_validate({"data": {"task": "parquet", "train_path": path}, "rollout": {"max_model_len": 2048, "max_tokens": 1024}})
    out = {"rss_before_mib": rss_mib()}
    began = time.perf_counter()
    stream = train_stream(cfg, tokenizer)
    out.update(index_s=time.perf_counter() - began, rss_after_index_mib=rss_mib(), rows=stream.index.num_rows,
               files=len(stream.index.files), row_groups=len(stream.index.group_rows))  # fmt: skip
    next(stream)
    out["first_prompt_s"] = time.perf_counter() - began
    [next(stream) for _ in range(BATCH - 1)]
    out.update(first_batch_s=time.perf_counter() - began, rss_after_first_batch_mib=rss_mib())
    drawing = time.perf_counter()
    for _ in range(batches - 1):
        [next(stream) for _ in range(BATCH)]
    out.update(prompts_per_s=(batches - 1) * BATCH / (time.perf_counter() - drawing), batches=batches,
               rss_after_batches_mib=rss_mib(), windows_visited=stream._window + 1, dropped=stream.dropped)  # fmt: skip
    return out


def measure_whole_file(path: str) -> dict:
    """In this process: the replaced path, one file read and tokenized whole, then cycled (the `whole_file` child)."""
    import itertools

    import pyarrow.parquet as pq

    from asyncrl.envs.data import check_verl_rows, encode_messages
    from asyncrl.models.bpe import production_tokenizer
    from asyncrl.types import Prompt

    tokenizer = production_tokenizer("chatml")
    out = {"rss_before_mib": rss_mib()}
    began = time.perf_counter()
    rows = pq.read_table(path).to_pylist()
    check_verl_rows(rows, path)
    prompts = [
        Prompt(str(r["extra_info"]["index"]), encode_messages(tokenizer, r["prompt"]), r["reward_model"]["ground_truth"],
               r["prompt"][-1]["content"], r["data_source"], r["extra_info"])
        for r in rows
    ]  # fmt: skip
    stream = itertools.cycle(prompts)
    [next(stream) for _ in range(BATCH)]
    out.update(first_batch_s=time.perf_counter() - began, rss_after_first_batch_mib=rss_mib(), rows=len(prompts))
    return out


def child(mode: str, path: str, batches: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, __file__, "--child", mode, "--path", path, "--batches", str(batches)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = result.pop("maxrss_mib")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_options(parser, "data_scale", "100,000 rows, whole-file path on 20,000")
    parser.add_argument("--batches", type=int, default=200, help="batches of 64 prompts drawn after the first")
    parser.add_argument("--whole-rows", type=int, default=None, help="rows of the whole-file comparison")
    parser.add_argument("--child", choices=["stream", "whole_file"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.set_runtime_env()
    if args.child:
        import resource

        result = measure_stream(args.path, args.batches) if args.child == "stream" else measure_whole_file(args.path)
        result["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    load = common.load_average()
    rows, files, group = (100_000, 20, 2_000) if args.quick else (1_000_000, 20, 10_000)
    whole_rows = args.whole_rows or (20_000 if args.quick else 100_000)
    with tempfile.TemporaryDirectory(prefix="data_scale-") as tmp:
        folder = Path(tmp) / "train"
        written_s = write_dataset(folder, rows, files, group)
        size = sum(f.stat().st_size for f in folder.iterdir())
        whole = Path(tmp) / "whole" / "train.parquet"
        write_dataset(whole.parent, whole_rows, 1, group)
        (whole.parent / "train-00000.parquet").rename(whole)
        stream = child("stream", str(folder), args.batches)
        old = child("whole_file", str(whole), 1)
    result = {
        "dataset": {"rows": rows, "files": files, "row_group_rows": group, "bytes": size, "write_s": round(written_s, 1)},
        "stream": stream,
        "whole_file": old,
        "tokenizer": "production_tokenizer('chatml') (tekken BPE, 131k ids)",
        "machine": common.machine(load),
    }
    path = common.output_path("data_scale", args)
    common.write_json(path, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
