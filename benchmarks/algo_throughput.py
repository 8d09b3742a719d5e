"""Throughput of asyncrl.algo policy losses: tokens/s of loss + backward on CPU, relative to plain PPO.

Each case runs `compute_policy_loss` (correction -> surrogate -> weighted sum) and `backward()` on a
[B x T] batch of fp32 log-probs with ~10% padding, through the same entry point the learner uses.

    python benchmarks/algo_throughput.py           # [64 x 2048], ~30 s on 2 CPU cores
    python benchmarks/algo_throughput.py --quick   # [8 x 256], 2 reps: a smoke test

Prints a table and writes JSON to benchmarks/results/algo_throughput.json (`--quick`:
algo_throughput_quick.json, so a smoke run never overwrites the real numbers).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.algo.recipes import compute_policy_loss, compute_token_weights, resolve_recipe  # noqa: E402

# (case name, recipe overrides). The first case is the baseline of the ratio column.
CASES = [
    ("ppo", {"loss": "ppo"}),
    ("ppo+dual_clip", {"loss": "ppo", "dual_clip_c": 3.0}),
    ("cispo", {"loss": "cispo"}),
    ("gspo", {"loss": "gspo", "reduction": "seq_mean_token_mean"}),
    ("gspo_token", {"loss": "gspo_token", "reduction": "seq_mean_token_mean"}),
    ("sapo", {"loss": "sapo"}),
    ("dppo_tv", {"loss": "dppo_tv"}),
    ("dppo_kl", {"loss": "dppo_kl"}),
    ("gvpo", {"loss": "gvpo", "reduction": "seq_mean_token_sum"}),
    ("reinforce", {"loss": "reinforce"}),
    ("ppo+tis", {"loss": "ppo", "correction": "tis"}),
    ("ppo+mis_seq", {"loss": "ppo", "correction": "mis_seq"}),
    ("ppo+icepop", {"loss": "ppo", "correction": "icepop"}),
    ("reinforce+dis", {"loss": "reinforce", "correction": "dis"}),
    ("ppo+kl_k3", {"loss": "ppo", "kl_coef": 0.001}),
]


def make_batch(batch: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(length * 0.8), length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old = -torch.rand(batch, length, generator=gen) * 3
    learner = old + 0.1 * torch.randn(batch, length, generator=gen)
    rollout = old + 0.1 * torch.randn(batch, length, generator=gen)
    ref = old + 0.1 * torch.randn(batch, length, generator=gen)
    learner = torch.where(mask, learner, torch.full_like(learner, float("-inf")))  # padded like real batches
    adv = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    group_ids = torch.arange(batch) // 8
    return dict(mask=mask, old=old, learner=learner, rollout=rollout, ref=ref, adv=adv, group_ids=group_ids)


def prepare(overrides: dict, data: dict):
    params = {"advantage": "grpo", "reduction": "token_mean", **overrides}
    recipe = resolve_recipe(None, **params)
    weights = compute_token_weights(recipe, data["mask"], data["group_ids"], data["old"], data["rollout"])
    return recipe, weights


def run_once(recipe, weights, data: dict) -> float:
    """Seconds of one loss + backward."""
    learner = data["learner"].clone().requires_grad_(True)
    start = time.perf_counter()
    loss, _ = compute_policy_loss(
        recipe, learner, data["old"], data["rollout"], data["adv"], data["mask"], weights,
        data["group_ids"], data["ref"],
    )  # fmt: skip
    loss.backward()
    return time.perf_counter() - start


def time_cases(data: dict, reps: int) -> dict[str, float]:
    """Best-of-reps seconds per case. Cases are interleaved round-robin so that load from other processes
    hits all of them alike, and the minimum is the least disturbed sample."""
    prepared = {name: prepare(overrides, data) for name, overrides in CASES}
    for recipe, weights in prepared.values():  # warm-up: allocator, kernels, lazy imports
        run_once(recipe, weights, data)
    best = {name: float("inf") for name in prepared}
    for _ in range(reps):
        for name, (recipe, weights) in prepared.items():
            best[name] = min(best[name], run_once(recipe, weights, data))
    return best


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_options(parser, "algo_throughput", "[8 x 256], 2 reps (smoke test)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch (default 64)")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (default 2048)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser.parse_args()


def rank_cases(best: dict[str, float], tokens: int) -> list[dict]:
    """One row per case in `CASES` order: ms, tokens/s, and tokens/s relative to the first case."""
    rows = [{"case": name, "ms": best[name] * 1e3, "tokens_per_s": tokens / best[name]} for name, _ in CASES]
    for row in rows:
        row["vs_ppo"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def print_table(rows: list[dict], batch: int, length: int, tokens: int, reps: int) -> None:
    print(f"asyncrl.algo loss+backward, [{batch} x {length}] fp32, {tokens} valid tokens, "
          f"best of {reps}, torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'case':<16}{'ms':>10}{'Mtok/s':>10}{'vs ppo':>9}")
    for row in rows:
        print(f"{row['case']:<16}{row['ms']:>10.2f}{row['tokens_per_s'] / 1e6:>10.2f}{row['vs_ppo']:>9.2f}")


def result_record(rows: list[dict], batch: int, length: int, tokens: int, reps: int, load: float) -> dict:
    return {
        "benchmark": "algo_throughput",
        "shape": [batch, length],
        "valid_tokens": tokens,
        "reps": reps,
        "statistic": "min over reps, cases interleaved",
        "dtype": "float32",
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": load,
        "baseline": "ppo",
        "rows": rows,
    }


def main() -> None:
    args = parse_args()
    batch = args.batch or (8 if args.quick else 64)
    length = args.length or (256 if args.quick else 2048)
    reps = args.reps or (2 if args.quick else 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = make_batch(batch, length)
    tokens = int(data["mask"].sum())
    rows = rank_cases(time_cases(data, reps), tokens)
    print_table(rows, batch, length, tokens, reps)

    load = common.load_average()
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} exceeds {os.cpu_count()} CPUs; timings are disturbed by other processes")
    out = common.output_path("algo_throughput", args)
    common.write_json(out, result_record(rows, batch, length, tokens, reps, load))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
