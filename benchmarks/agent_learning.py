"""The `calc` agent task: held-out success and tool-call rate against wall-clock for `sao_agent` and
`grpo_agent`, and episodes per second.

Both recipes start from the same cached warm start (it calls the calculator on some prompts and copies its
result unreliably), one after the other in one Ray session. Held-out evaluation runs greedy episodes on 200
fixed-seed problems every `--every` steps; wall-clock excludes the evaluations. Episodes/s counts every
trained episode over the run's wall-clock without evaluations. Writes benchmarks/results/agent_learning.json.

    python benchmarks/agent_learning.py [--quick] [--steps N] [--every K] [--out PATH]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

RECIPES = ("sao_agent", "grpo_agent")


def main() -> None:
    args = _parse()
    common.set_runtime_env()
    load_start = common.load_average()
    steps, every = (2, 1) if args.quick else (args.steps, args.every)
    results = runs(Path(tempfile.mkdtemp(prefix="agent_learning-")), steps, every)
    print_table(results, steps)
    common.write_json(common.output_path("agent_learning", args), {"steps": steps, "machine": common.machine(load_start), "recipes": results})


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "agent_learning", "smoke run: two steps per recipe")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="held-out evaluation period in steps")
    return parser.parse_args()


def runs(out: Path, steps: int, every: int) -> dict[str, dict]:
    import ray

    from asyncrl.config import load_config
    from asyncrl.controller.run import run

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = {}
    for name in RECIPES:
        overrides = [f"output_dir={out / name}", f"learner.max_steps={steps}", f"eval.every_steps={every}", "telemetry.progress=false",
                     "checkpoint.export_hf=false"]
        summary = run(load_config(name, overrides))
        results[name] = figures(summary)
    ray.shutdown()
    return results


def figures(summary: dict) -> dict:
    evals = summary["evals"]
    train_s = evals[-1]["wall_s_excl_eval"] if evals else summary["wall_clock_s"]
    return {
        "start_success": evals[0]["accuracy"],
        "final_success": evals[-1]["accuracy"],
        "start_tool_call_rate": evals[0]["tool_call_rate"],
        "final_tool_call_rate": evals[-1]["tool_call_rate"],
        "wall_clock_s": summary["wall_clock_s"],
        "train_wall_s_excl_eval": train_s,
        "episodes_trained": summary["samples_trained"],
        "episodes_per_s": round(summary["samples_trained"] / max(train_s, 1e-9), 2),
        "curve": [(e["wall_s_excl_eval"], e["accuracy"], e["tool_call_rate"]) for e in evals],
    }


def print_table(results: dict, steps: int) -> None:
    print(f"\ncalc agent task, {steps} steps per recipe (held-out success and tool-call rate, greedy episodes)")
    print(f"{'recipe':<11} {'success':>15} {'tool calls':>15} {'train s':>8} {'episodes':>9} {'episodes/s':>10}")
    for name, r in results.items():
        success = f"{r['start_success']:.3f}->{r['final_success']:.3f}"
        tools = f"{r['start_tool_call_rate']:.3f}->{r['final_tool_call_rate']:.3f}"
        print(f"{name:<11} {success:>15} {tools:>15} {r['train_wall_s_excl_eval']:>8.0f} {r['episodes_trained']:>9d} {r['episodes_per_s']:>10.2f}")
    for name, r in results.items():
        print(f"{name} curve (train s, success, tool-call rate): " + ", ".join(f"({s:.0f}, {a:.3f}, {t:.3f})" for s, a, t in r["curve"]))


if __name__ == "__main__":
    main()
