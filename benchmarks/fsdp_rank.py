"""FSDP2 on the learner (`learner.fsdp`, `learner.rank_memory_gb`): what wrapping one rank costs, and what sharding
over two ranks saves.

Step time: one rank (gloo, world size 1, one torch thread as `learner.num_cpus_per_rank` = 1 gives it) takes GRPO
steps on a W1-sized batch (32 prompts x 8 samples, 8-12 prompt and 6 response tokens) of the add-1m model, plain
(`learner.fsdp: never`; in bf16 its layers cast by `policy.cast_layers`) and FSDP2-wrapped (`always`), the two
alternating step by step after a warm-up step each; the ratio wrapped / plain of the median step, in fp32 and bf16.

Memory: one and then two ranks (real processes, gloo) build the train state of a larger model (w3-25m, 23.6M
parameters) and take one step; each rank reports the bytes it holds (its shards of the fp32 parameters and AdamW
moments, `learner.memory.held_bytes`), its resident memory after the step above what it had before loading the
model, and its peak; next to `learner.memory.rank_need`, what `learner.rank_memory_gb` is checked against. The rank
processes run with glibc's `MALLOC_MMAP_THRESHOLD_=65536`, so that memory they free (the whole model loaded before
sharding, the step's activations) leaves their resident set: with glibc's default the freed blocks of under 32 MB
stay in its heap, and the resident growth of a rank of two read 0.92-1.07 of one rank's while it held half as much.

    python benchmarks/fsdp_rank.py [--quick]     # ~2 min on 2 cores (quick: tiny models, ~30 s)

Writes benchmarks/results/fsdp_rank.json (`--quick`: fsdp_rank_quick.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.algo.recipes import resolve_recipe  # noqa: E402
from asyncrl.algo.sampling import RAW  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402

RECIPE = resolve_recipe("grpo")
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def w1_groups(vocab: int, num_groups: int = 32, group_size: int = 8, seed: int = 0):
    """W1's shape: 32 prompts x 8 samples, 8-12 prompt tokens, 6 response tokens, rewards with variance."""
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, int(rng.integers(8, 13)))
        members = [
            make_trajectory(rng.integers(3, vocab, 6), prompt_ids=prompt, group_id=f"g{g}", prompt_id=f"p{g}",
                            sample_index=i, rollout_logprobs=-rng.random(6) * 3, reward=float(i % 2))
            for i in range(group_size)
        ]  # fmt: skip
        groups.append(Group(f"g{g}", members))
    return groups


def _all_reduce(tensor, op="sum"):
    import torch.distributed as dist

    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def _rank_step(model_dir: str, fsdp: str, dtype: torch.dtype, num_ranks: int = 1):
    """A rank's train state and step as `LearnerWorker.setup` builds them (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    cfg = LearnerConfig(lr=1e-4, fsdp=fsdp, num_ranks=num_ranks)
    mesh = init_device_mesh("cpu", (num_ranks,))
    torch.manual_seed(0)
    state = build_train_state(cfg, model_dir, torch.device("cpu"), lambda m: shard(m, mesh, dtype, fsdp))
    return state, RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), _all_reduce)


def step_times(model_dir: str, dtype: torch.dtype, steps: int) -> dict:
    """Median seconds per step, plain and wrapped, alternating."""
    from asyncrl.learner.batch import build_batch

    torch.set_num_threads(1)
    batch = build_batch(w1_groups(_vocab(model_dir)), RECIPE)
    runs = {fsdp: _rank_step(model_dir, fsdp, dtype)[1] for fsdp in ("never", "always")}
    times: dict[str, list[float]] = {fsdp: [] for fsdp in runs}
    for i in range(steps + 1):
        for fsdp, step in runs.items():
            began = time.perf_counter()
            step.train([batch], i)
            if i:  # the first step of each is a warm-up
                times[fsdp].append(time.perf_counter() - began)
    plain, wrapped = (statistics.median(times[f]) for f in ("never", "always"))
    return {"dtype": str(dtype).removeprefix("torch."), "rows": batch.num_rows, "tokens": int(batch.attention_mask.sum()),
            "steps": steps, "plain_s": plain, "wrapped_s": wrapped, "ratio": wrapped / plain,
            "plain_all_s": times["never"], "wrapped_all_s": times["always"]}  # fmt: skip


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def _memory_rank(rank: int, num_ranks: int, model_dir: str, store_dir: str, fsdp: str, out) -> None:
    """One rank of the memory run (a spawned process): load, shard, one step, report."""
    import torch.distributed as dist

    from asyncrl.learner.batch import build_batch, split_rows
    from asyncrl.learner.memory import held_bytes, resident_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", num_ranks), rank=rank, world_size=num_ranks)
    batch = build_batch(w1_groups(_vocab(model_dir), num_groups=8), RECIPE)
    before = resident_bytes()["rss_bytes"]
    state, step = _rank_step(model_dir, fsdp, torch.float32, num_ranks)
    step.train([split_rows(batch, num_ranks)[rank]], 0)
    after = resident_bytes()
    out.put({"rank": rank, **held_bytes(state), "rss_growth_bytes": after["rss_bytes"] - before,
             "rss_bytes": after["rss_bytes"], "peak_rss_bytes": after["peak_rss_bytes"]})  # fmt: skip
    dist.destroy_process_group()


def memory(model_dir: str, num_ranks: int, fsdp: str = "auto") -> dict:
    import torch.multiprocessing as mp

    from asyncrl.learner.memory import parameter_shapes, rank_need

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as store:
        procs = [ctx.Process(target=_memory_rank, args=(r, num_ranks, model_dir, store, fsdp, out)) for r in range(num_ranks)]
        saved = os.environ.get(MMAP_THRESHOLD)
        os.environ[MMAP_THRESHOLD] = "65536"  # read by the ranks' glibc at start (module docstring)
        try:
            for p in procs:
                p.start()
        finally:
            os.environ.pop(MMAP_THRESHOLD) if saved is None else os.environ.update({MMAP_THRESHOLD: saved})
        ranks = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    need = rank_need(parameter_shapes(model_dir), num_ranks)
    return {"num_ranks": num_ranks, "fsdp": fsdp, "parameters": need.parameters, "need_bytes": need.need,
            "state_bytes": need.state, "ranks": ranks}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "fsdp_rank", "tiny models, few steps: a smoke test")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and dtype")
    args = parser.parse_args()
    common.set_runtime_env()
    import torch.distributed as dist

    from asyncrl.models import build_model

    load_start = common.load_average()
    step_preset, memory_preset = ("tiny-0.3m", "w3-0.5m") if args.quick else ("add-1m", "w3-25m")
    steps = 3 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        step_dir, memory_dir = (str(build_model(p, Path(tmp) / p, seed=0)) for p in (step_preset, memory_preset))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        timing = [step_times(step_dir, dtype, steps) for dtype in (torch.float32, torch.bfloat16)]
        dist.destroy_process_group()
        mem = [memory(memory_dir, 1, "never"), memory(memory_dir, 1, "always"), memory(memory_dir, 2)]
    result = {"step_preset": step_preset, "memory_preset": memory_preset, "step_time": timing, "memory": mem,
              "machine": common.machine(load_start)}  # fmt: skip
    _print(result)
    common.write_json(common.output_path("fsdp_rank", args), result)


def _print(result: dict) -> None:
    for t in result["step_time"]:
        print(f"{t['dtype']}: plain {t['plain_s']:.3f} s, wrapped {t['wrapped_s']:.3f} s per step: {t['ratio']:.2f}x")
    whole = result["memory"][0]["ranks"][0]
    for m in result["memory"]:
        for r in m["ranks"]:
            held = r["param_bytes"] + r["optimizer_bytes"]
            print(f"{m['num_ranks']} rank(s), fsdp {m['fsdp']}, rank {r['rank']}: holds {held / 1e6:.1f} MB "
                  f"({held / (whole['param_bytes'] + whole['optimizer_bytes']):.3f} of one rank), RSS growth "
                  f"{r['rss_growth_bytes'] / 1e6:.0f} MB ({r['rss_growth_bytes'] / whole['rss_growth_bytes']:.3f}), "
                  f"peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB; computed need {m['need_bytes'] / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
