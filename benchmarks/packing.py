"""Sequence packing and shared group prompts in the learner (`learner.packing`, `learner.share_group_prompt`):
padding and learner time per trained token on W1- and W2-shaped batches, the three layouts side by side.

One learner rank (plain, fp32, one torch thread as `learner.num_cpus_per_rank` = 1 gives it, gloo world of one)
takes GRPO steps of the add-1m model on the same rollout batch in three layouts, alternating step by step after a
warm-up step each: padded rows (`packing: false`, the rows of a micro-batch padded to its longest), packed bins
(`share_group_prompt: false`) and packed bins with one prompt segment per group (the default).

    W1: 32 prompts x 8 samples, prompts of 8-12 tokens, responses of 2-8 (an `add` answer and end-of-sequence,
        or a wrong answer running on)
    W2: 16 prompts x 8 samples, prompts of 8-12 tokens, responses log-normal with median 32 and p99 512 (cut at
        500), as W2's heavy-tailed `max_tokens` give them

Figures per layout: slots (positions the forward computes, padding included), padding fraction (1 - tokens the
forward computes / slots), prompt recomputation saved (1 - tokens computed / trained tokens), median seconds per
step, per 256 samples and per 1,000 trained tokens (trained tokens = prompt + response of every sample, the unit of
`StepStats.num_tokens`), and the ratio to the padded step.

    python benchmarks/packing.py [--quick] [--steps N]     # ~3 min on 2 cores (quick: 2 steps, ~40 s)

Writes benchmarks/results/packing.json (`--quick`: packing_quick.json).
"""

from __future__ import annotations

import argparse
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
LAYOUTS = {
    "padded": {"packing": False},
    "packed": {"packing": True, "share_group_prompt": False},
    "shared": {"packing": True, "share_group_prompt": True},
}


def groups(workload: str, vocab: int, seed: int = 0):
    """A W1- or W2-shaped rollout batch (module docstring), rewards with variance in every group."""
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng = np.random.default_rng(seed)
    num_groups = 32 if workload == "W1" else 16
    out = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, int(rng.integers(8, 13)))
        if workload == "W1":
            lengths = rng.integers(2, 9, 8)
        else:
            lengths = np.clip(np.rint(rng.lognormal(np.log(32), np.log(512 / 32) / 2.326, 8)), 1, 500).astype(int)
        members = [
            make_trajectory(rng.integers(3, vocab, n), prompt_ids=prompt, group_id=f"g{g}", prompt_id=f"p{g}",
                            sample_index=i, rollout_logprobs=-rng.random(n) * 3, reward=float(i % 2))
            for i, n in enumerate(lengths)
        ]  # fmt: skip
        out.append(Group(f"g{g}", members))
    return out


def _rank_step(model_dir: str, layout: str):
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    cfg = LearnerConfig(lr=1e-6, **LAYOUTS[layout])
    torch.manual_seed(0)
    state = build_train_state(cfg, model_dir, torch.device("cpu"), lambda m: None)
    return RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), lambda t, op="sum": t)


def _shape(step, batch) -> dict:
    mbs, _ = step._micro_batches(batch)
    slots = sum(mb.num_slots for mb in mbs)
    computed = sum(mb.layout.tokens if mb.layout is not None else mb.num_tokens for mb in mbs)
    return {"micro_batches": len(mbs), "slots": slots, "computed_tokens": computed,
            "padding_frac": 1 - computed / slots, "recompute_saved_frac": 1 - computed / batch.num_tokens}  # fmt: skip


def workload(model_dir: str, name: str, steps: int) -> dict:
    from asyncrl.learner.batch import build_batch

    from_config = __import__("transformers").AutoConfig.from_pretrained(model_dir)
    batch = build_batch(groups(name, from_config.vocab_size), RECIPE)
    runs = {layout: _rank_step(model_dir, layout) for layout in LAYOUTS}
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for i in range(steps + 1):
        for layout, step in runs.items():
            began = time.perf_counter()
            step.train([batch], i)
            if i:  # the first step of each is a warm-up
                times[layout].append(time.perf_counter() - began)
    out = {"workload": name, "samples": batch.num_rows, "trained_tokens": batch.num_tokens,
           "loss_tokens": batch.num_loss_tokens, "steps": steps, "layouts": {}}  # fmt: skip
    padded_s = statistics.median(times["padded"])
    for layout, step in runs.items():
        median = statistics.median(times[layout])
        out["layouts"][layout] = {**_shape(step, batch), "step_s": median, "per_256_samples_s": median * 256 / batch.num_rows,
                                  "per_1k_tokens_s": median * 1000 / batch.num_tokens, "vs_padded": median / padded_s,
                                  "all_step_s": times[layout]}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "packing", "2 steps per layout: a smoke test")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout and workload")
    args = parser.parse_args()
    common.set_runtime_env()
    import torch.distributed as dist

    from asyncrl.learner.packing import PACK_WIDTH
    from asyncrl.models import build_model

    torch.set_num_threads(1)
    load_start = common.load_average()
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model("add-1m", Path(tmp) / "add-1m", seed=0))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        results = [workload(model_dir, name, steps) for name in ("W1", "W2")]
        dist.destroy_process_group()
    result = {"preset": "add-1m", "tokens_per_microbatch": LearnerConfig().tokens_per_microbatch,
              "pack_width": PACK_WIDTH, "workloads": results, "machine": common.machine(load_start)}  # fmt: skip
    _print(result)
    common.write_json(common.output_path("packing", args), result)


def _print(result: dict) -> None:
    for w in result["workloads"]:
        print(f"{w['workload']}: {w['samples']} samples, {w['trained_tokens']} trained tokens, {w['steps']} steps")
        for name, r in w["layouts"].items():
            print(f"  {name:7s} {r['micro_batches']:3d} micro-batches, {r['slots']:6d} slots, padding "
                  f"{r['padding_frac']:.3f}, prompt recompute saved {r['recompute_saved_frac']:.3f}: "
                  f"{r['step_s']:.3f} s/step, {r['per_256_samples_s']:.3f} s/256 samples, "
                  f"{r['per_1k_tokens_s'] * 1000:.1f} ms/1k tokens, {r['vs_padded']:.2f}x padded")  # fmt: skip


if __name__ == "__main__":
    main()
