"""The megatron learner backend's step time next to FSDP2's (`learner.training_backend`), on the W1 learner step.

W1-sized GRPO steps (32 prompts x 8 samples, `fsdp_rank.w1_groups`) of the add-1m model, fp32, gloo, one torch thread
per rank (`learner.num_cpus_per_rank` = 1):

- one rank in this process: FSDP2's plain module (`learner.fsdp: auto`) and megatron at TP=1, alternating step by
  step after a warm-up step each;
- two ranks (spawned processes): FSDP2 over two ranks (data parallel, sharded), megatron TP=2 (both ranks every row,
  each half of every layer) and megatron DP=2 (half the rows each), one after the other.

The median step of each, in seconds, and every step's time.

    python benchmarks/megatron_step.py [--quick]     # ~2 min on 2 cores (quick: tiny-0.3m, 3 steps)

Writes benchmarks/results/megatron_step.json (`--quick`: megatron_step_quick.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path
import torch
from fsdp_rank import w1_groups

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.algo.recipes import resolve_recipe  # noqa: E402
from asyncrl.algo.sampling import RAW  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402

RECIPE = resolve_recipe("grpo")


def _all_reduce(tensor, op="sum"):
    import torch.distributed as dist

    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def _rank_step(model_dir: str, backend: str, num_ranks: int = 1, tensor_parallel: int = 1):
    """A rank's step as `LearnerWorker.setup` builds it (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    from asyncrl.learner.step import RankStep

    cfg = LearnerConfig(lr=1e-4, num_ranks=num_ranks, training_backend=backend, tensor_parallel=tensor_parallel)
    torch.manual_seed(0)
    if backend == "megatron":
        from asyncrl.learner.megatron.state import build_megatron_train_state, data_parallel_all_reduce

        state = build_megatron_train_state(cfg, model_dir, torch.device("cpu"))
        return RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), data_parallel_all_reduce)
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state

    mesh = init_device_mesh("cpu", (num_ranks,))
    state = build_train_state(cfg, model_dir, torch.device("cpu"), lambda m: shard(m, mesh, torch.float32))
    return RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), _all_reduce)


def _batch(model_dir: str):
    from transformers import AutoConfig

    from asyncrl.learner.batch import build_batch

    return build_batch(w1_groups(AutoConfig.from_pretrained(model_dir).vocab_size), RECIPE)


def one_rank(model_dir: str, steps: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    batch = _batch(model_dir)
    runs = {b: _rank_step(model_dir, b) for b in ("fsdp2", "megatron")}
    times: dict[str, list[float]] = {b: [] for b in runs}
    for i in range(steps + 1):
        for backend, step in runs.items():
            began = time.perf_counter()
            step.train([batch], i)
            if i:  # the first step of each is a warm-up
                times[backend].append(time.perf_counter() - began)
    dist.destroy_process_group()
    return {f"{b}_s": statistics.median(t) for b, t in times.items()} | {f"{b}_all_s": t for b, t in times.items()}


def _two_rank_worker(rank: int, store_dir: str, model_dir: str, variant: str, steps: int, out) -> None:
    import torch.distributed as dist

    from asyncrl.learner.batch import split_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 2), rank=rank, world_size=2)
    backend, tp = {"fsdp2_dp2": ("fsdp2", 1), "megatron_tp2": ("megatron", 2), "megatron_dp2": ("megatron", 1)}[variant]
    step = _rank_step(model_dir, backend, num_ranks=2, tensor_parallel=tp)
    batch = _batch(model_dir)
    rows = batch if tp == 2 else split_rows(batch, 2)[rank]
    times = []
    for i in range(steps + 1):
        dist.barrier()
        began = time.perf_counter()
        step.train([rows], i)
        if i:
            times.append(time.perf_counter() - began)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def two_ranks(model_dir: str, variant: str, steps: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as store:
        procs = [ctx.Process(target=_two_rank_worker, args=(r, store, model_dir, variant, steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        times = out.get(timeout=900)
        for p in procs:
            p.join()
    return {f"{variant}_s": statistics.median(times), f"{variant}_all_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "megatron_step", "tiny-0.3m, 3 steps: a smoke test")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parser.parse_args()
    common.set_runtime_env()
    from asyncrl.models import build_model

    load_start = common.load_average()
    preset, steps = ("tiny-0.3m", 3) if args.quick else ("add-1m", args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(preset, Path(tmp) / preset, seed=0))
        result = {"preset": preset, "steps": steps, "rows": _batch(model_dir).num_rows, **one_rank(model_dir, steps)}
        for variant in ("fsdp2_dp2", "megatron_tp2", "megatron_dp2"):
            result.update(two_ranks(model_dir, variant, steps))
    result["machine"] = common.machine(load_start)
    for key in ("fsdp2_s", "megatron_s", "fsdp2_dp2_s", "megatron_tp2_s", "megatron_dp2_s"):
        print(f"{key.removesuffix('_s')}: {result[key]:.3f} s per step")
    common.write_json(common.output_path("megatron_step", args), result)


if __name__ == "__main__":
    main()
