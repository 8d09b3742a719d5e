"""`learner.activation_checkpointing`: what recomputing the decoder layers' activations in the backward costs in step
time and saves in memory.

One rank (gloo, world size 1, one torch thread as `learner.num_cpus_per_rank` = 1 gives it, plain module, fp32) takes
GRPO steps of the add-1m model (4 layers) with and without checkpointing, the two alternating step by step after a
warm-up step each, on two batches: W1's (32 prompts x 8 samples, 8-12 prompt and 6 response tokens) and a long one
(4 rows of 1,024 tokens: a 1,000-token response to a 24-token prompt). Memory: the peak bytes of one forward +
backward of each batch's tokens (`learner.memory.forward_backward_peak`: torch's `MemTracker`, which counts every
live tensor, so the figure is the same on every run), its activations and in all.

    python benchmarks/activation_checkpointing.py [--quick]     # ~2 min on 2 cores (quick: tiny model, ~20 s)

Writes benchmarks/results/activation_checkpointing.json (`--quick`: activation_checkpointing_quick.json).
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
from fsdp_rank import RECIPE, _all_reduce, _vocab, w1_groups

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.algo.sampling import RAW  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402


def long_groups(vocab: int, rows: int, length: int, seed: int = 1):
    """One group of `rows` samples: a 24-token prompt and a response filling `length` tokens."""
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng = np.random.default_rng(seed)
    prompt, response = rng.integers(3, vocab, 24), length - 24
    members = [
        make_trajectory(rng.integers(3, vocab, response), prompt_ids=prompt, group_id="g0", prompt_id="p0",
                        sample_index=i, rollout_logprobs=-rng.random(response) * 3, reward=float(i % 2))
        for i in range(rows)
    ]  # fmt: skip
    return [Group("g0", members)]


def _rank_step(model_dir: str, checkpointing: bool):
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    cfg = LearnerConfig(lr=1e-4, fsdp="never", activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    state = build_train_state(cfg, model_dir, torch.device("cpu"))
    return state, RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), _all_reduce)


def measure(model_dir: str, name: str, groups, steps: int) -> dict:
    """Median step time and forward + backward peak bytes, without and with checkpointing."""
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.memory import forward_backward_peak

    batch = build_batch(groups, RECIPE)
    runs = {c: _rank_step(model_dir, c) for c in (False, True)}
    ids = batch.input_ids[:, : int(batch.attention_mask.sum(1).min())]  # every row's real tokens, no padding
    peaks = {c: forward_backward_peak(state.policy, ids) for c, (state, _) in runs.items()}
    times: dict[bool, list[float]] = {c: [] for c in runs}
    for i in range(steps + 1):
        for c, (_, step) in runs.items():
            began = time.perf_counter()
            step.train([batch], i)
            if i:  # the first step of each is a warm-up
                times[c].append(time.perf_counter() - began)
    plain, checkpointed = (statistics.median(times[c]) for c in (False, True))
    return {"batch": name, "rows": batch.num_rows, "tokens": int(batch.attention_mask.sum()),
            "peak_tokens": list(ids.shape), "steps": steps, "plain_s": plain, "checkpointed_s": checkpointed,
            "time_ratio": checkpointed / plain, "plain_peak": peaks[False], "checkpointed_peak": peaks[True],
            "activation_ratio": peaks[True]["activation"] / peaks[False]["activation"],
            "plain_all_s": times[False], "checkpointed_all_s": times[True]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "activation_checkpointing", "tiny model, few steps: a smoke test")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and batch")
    args = parser.parse_args()
    common.set_runtime_env()
    import torch.distributed as dist

    from asyncrl.models import build_model

    load_start = common.load_average()
    preset, steps, length = ("tiny-0.3m", 2, 256) if args.quick else ("add-1m", args.steps, 1024)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(preset, Path(tmp) / preset, seed=0))
        vocab = _vocab(model_dir)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        cases = [measure(model_dir, "W1", w1_groups(vocab), steps),
                 measure(model_dir, f"4 x {length}", long_groups(vocab, 4, length), max(2, steps // 2))]  # fmt: skip
        dist.destroy_process_group()
    result = {"preset": preset, "cases": cases, "machine": common.machine(load_start)}
    for c in cases:
        print(f"{c['batch']}: {c['plain_s']:.3f} -> {c['checkpointed_s']:.3f} s per step ({c['time_ratio']:.2f}x); "
              f"peak activations {c['plain_peak']['activation'] / 1e6:.1f} -> "
              f"{c['checkpointed_peak']['activation'] / 1e6:.1f} MB ({c['activation_ratio']:.2f})")  # fmt: skip
    common.write_json(common.output_path("activation_checkpointing", args), result)


if __name__ == "__main__":
    main()
