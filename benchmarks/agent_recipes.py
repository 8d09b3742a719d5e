"""Do the agent recipes hold their gains? `sao_agent`, `grpo_agent` (and `word_problems`) over twice their
default `learner.max_steps`, for several seeds: held-out success every `--every` steps, its best, its final
value and its drop: the most any evaluation falls below the best evaluation before it.

Each (recipe, seed) is one `asyncrl run <recipe> seed=<s> ...` process (its own warm start, cached per
seed, and its own Ray session), run one after the other; the curve is read from the `eval` records of the
run's `events.jsonl` (metrics.jsonl holds the step rows). A recipe holds when, for every seed, no evaluation
falls more than 0.05 below the best so far. Writes benchmarks/results/agent_recipes.json.

    python benchmarks/agent_recipes.py [--quick] [--recipes R ...] [--seeds S ...] [--every K] [--factor F]
        [--steps N] [--set section.key=value ...] [--out PATH]
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

RECIPES = ("sao_agent", "grpo_agent")
HOLD_TOLERANCE = 0.05
"""How far below its best held-out success a recipe's later evaluations may fall (issue #53.4)."""


def main() -> None:
    args = _parse()
    common.set_runtime_env()
    load_start = common.load_average()
    seeds = args.seeds[:1] if args.quick else args.seeds
    out = args.runs or Path(tempfile.mkdtemp(prefix="agent_recipes-"))
    results: dict[str, dict] = {}
    for recipe in args.recipes:
        steps = 2 if args.quick else args.steps or args.factor * default_steps(recipe)
        runs = [one_run(out, recipe, seed, steps, 1 if args.quick else args.every, args.set) for seed in seeds]
        results[recipe] = {
            "steps": steps,
            "every": 1 if args.quick else args.every,
            "seeds": runs,
            "holds": holds(runs),
        }
        print_recipe(recipe, results[recipe])
    payload = {
        "tolerance": HOLD_TOLERANCE,
        "overrides": args.set,
        "machine": common.machine(load_start),
        "recipes": results,
    }
    common.write_json(common.output_path("agent_recipes", args), payload)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "agent_recipes", "smoke run: two steps, one seed per recipe")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--every", type=int, default=5, help="held-out evaluation period in steps")
    parser.add_argument("--factor", type=int, default=2, help="run this many times the recipe's learner.max_steps")
    parser.add_argument("--steps", type=int, default=None, help="run this many steps (instead of --factor)")
    parser.add_argument("--set", nargs="*", default=[], help="extra section.key=value overrides for every run")
    runs_help = "folder of the run folders (default: a new temporary one); a finished run there is read, not rerun"
    parser.add_argument("--runs", type=Path, default=None, help=runs_help)
    return parser.parse_args()


def default_steps(recipe: str) -> int:
    from asyncrl.config import load_config

    return load_config(recipe, []).learner.max_steps


def one_run(out: Path, recipe: str, seed: int, steps: int, every: int, extra: list[str]) -> dict:
    """One CLI run of `recipe` with `seed`; its curve, best, final and drop (see `figures`)."""
    run_dir = out / f"{recipe}-seed{seed}"
    overrides = [f"output_dir={run_dir}", f"seed={seed}", f"learner.max_steps={steps}", f"eval.every_steps={every}",
                 "telemetry.progress=false", "checkpoint.export_hf=false", *extra]  # fmt: skip
    if finished(run_dir / "events.jsonl"):
        print(f"{recipe} seed {seed}: reading the finished run in {run_dir}", flush=True)
        read = {"seed": seed, "process_wall_s": None} | warm_start(recipe, overrides)
        return figures(eval_curve(run_dir / "events.jsonl")) | read
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", recipe, *overrides], env=dict(os.environ),
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{recipe} seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = figures(eval_curve(run_dir / "events.jsonl"))
    result |= {"seed": seed, "process_wall_s": round(time.perf_counter() - began, 1)} | warm_start(recipe, overrides)
    print(f"{recipe} seed {seed}: {result['curve']}", flush=True)
    return result


WARM_START_KEYS = ("steps", "train_seconds", "target", "target_reached", "validation_success", "success", "exact_call_rate")


def warm_start(recipe: str, overrides: list[str]) -> dict:
    """What the run's built start measured (its `warm_start.json`: steps, seconds, the target and its validation
    curve, held-out success): {} for a run given `model.path`. The build is cached, so this only reads it."""
    from asyncrl.config import load_config
    from asyncrl.envs.model_dir import ensure_model

    cfg = load_config(recipe, overrides)
    if cfg.model.path:
        return {}
    record = ensure_model(cfg) / "warm_start.json"
    if not record.is_file():
        return {}
    built = json.loads(record.read_text())
    return {"warm_start": {k: built[k] for k in WARM_START_KEYS if k in built}}


def finished(events: Path) -> bool:
    """Whether a run's events.jsonl ends with a `close` record without an error."""
    if not events.is_file():
        return False
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return any(r.get("kind") == "close" and not r["data"].get("error") for r in rows)


def eval_curve(events: Path) -> list[tuple[int, float, float | None]]:
    """(step, held-out success, tool-call rate) of each `eval` record of a run's events.jsonl."""
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    evals = [r.get("data", r) for r in rows if r.get("kind") == "eval"]
    if not evals:
        raise ValueError(f"{events} has no eval records")
    return [(int(e["step"]), float(e["accuracy"]), e.get("tool_call_rate")) for e in evals]


def figures(curve: list[tuple[int, float, float | None]]) -> dict:
    """Start, best (and its step), final, and drop: the most an evaluation falls below the best one before it."""
    accuracies = [a for _, a, _ in curve]
    best_at = max(range(len(accuracies)), key=accuracies.__getitem__)
    drop = max(max(accuracies[: i + 1]) - a for i, a in enumerate(accuracies))
    return {
        "start": accuracies[0], "best": accuracies[best_at], "best_step": curve[best_at][0], "final": accuracies[-1],
        "drop": round(drop, 4), "curve": curve,
    }  # fmt: skip


def holds(runs: list[dict]) -> bool:
    return all(r["drop"] <= HOLD_TOLERANCE + 1e-9 for r in runs)


def print_recipe(recipe: str, r: dict) -> None:
    print(f"\n{recipe}: {r['steps']} steps, held-out every {r['every']} (holds: {r['holds']})")
    print(f"{'seed':>4} {'start':>6} {'best':>6} {'at':>4} {'final':>6} {'drop':>6}")
    for s in r["seeds"]:
        figures = f"{s['start']:>6.3f} {s['best']:>6.3f} {s['best_step']:>4} {s['final']:>6.3f} {s['drop']:>6.3f}"
        print(f"{s['seed']:>4} {figures}")


if __name__ == "__main__":
    main()
