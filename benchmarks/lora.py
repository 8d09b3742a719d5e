"""W1 `add` with `learner.lora` next to full fine-tuning: held-out accuracy of the streaming recipe over the same
steps, from the same warm start, in one Ray session (`learning_add.asyncrl_runs`), and each run's weight sync
(bytes and seconds per sync, from its summary). LoRA trains the adapters alone (rank 16, alpha 32 on every
projection) at 10x the full fine-tuning lr, as LoRA usually needs; only the adapter travels to the engine.
Writes benchmarks/results/lora.json.

    python benchmarks/lora.py [--quick] [--steps N] [--lora-lr 2e-3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

LORA = ["learner.lora.rank=16", "learner.lora.alpha=32"]


def sync_figures(run_dir: Path) -> dict:
    """Mean bytes and seconds per weight sync of the run in `run_dir` (its metrics log)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    syncs = [(r["sync_bytes"], r["sync_s"]) for r in rows if r.get("sync_bytes") is not None]
    if not syncs:
        return {}
    return {"syncs": len(syncs), "bytes_per_sync": syncs[-1][0], "s_per_sync_mean": sum(s for _, s in syncs) / len(syncs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "lora", "smoke run: a few steps per run")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--lora-lr", type=float, default=2e-3, help="learner.lr of the LoRA run (full FT: the recipe's)")
    args = parser.parse_args()
    common.set_runtime_env()
    from learning_add import asyncrl_runs

    load_start = common.load_average()
    steps, every = (3, 1) if args.quick else (args.steps, 10)
    out = Path(tempfile.mkdtemp(prefix="lora-"))
    planned = [("full", "default.yaml", []), ("lora", "default.yaml", [*LORA, f"learner.lr={args.lora_lr}"])]
    results = asyncrl_runs(out, steps, every, 0.5, planned)
    for mode, r in results.items():
        r["gain"] = r["final_accuracy"] - r["start_accuracy"]
        r.update(sync_figures(out / mode))
        print(f"{mode:>5}: held-out {r['start_accuracy']:.3f} -> {r['final_accuracy']:.3f} (gain {r['gain']:+.3f}) in "
              f"{r['wall_clock_s']:.0f} s; sync {r.get('bytes_per_sync', 0):,} bytes, {r.get('s_per_sync_mean', 0):.3f} s")
    common.write_json(common.output_path("lora", args), {
        "machine": common.machine(load_start), "steps": steps, "lora": LORA, "lora_lr": args.lora_lr, "runs": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
