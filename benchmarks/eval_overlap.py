"""The learner's idle fraction during held-out evaluation, with `eval.blocking: true` (the loop waits for each
evaluation) against `false` (the default: the evaluation runs on the engine beside the rollouts while the learner
trains on, its version pinned by holding weight publications back).

The same run, side by side in rounds (default 2): the real controller loop (Ray, one vLLM CPU engine, one FSDP2
learner rank, the replay queue) in `streaming` mode on the tiny model (`tiny-0.3m`, random init), the default
`add` task, an evaluation every `--eval-every` steps of `--eval-prompts` prompts x `--eval-samples` samples at
temperature 1 (enough work that an evaluation spans several learner steps).

Figures per run: the learner's busy intervals (each step's `start_step` -> `finish_step`, timed in the driver),
the evaluation windows of the mid-run evaluations (start -> record; the first, before any batch, and the last
are waited for in both settings and left out), and
  learner idle during evaluation = 1 - (learner busy time inside the windows) / (the windows' time),
  learner idle overall = 1 - busy / run wall time,
the seconds the loop waited for evaluations, steps per second, the publications held back and the evaluations
that straddled a version (must be 0).

    python benchmarks/eval_overlap.py           # ~6 min on 2 CPU cores
    python benchmarks/eval_overlap.py --quick   # smoke size, writes eval_overlap_quick.json
    python benchmarks/eval_overlap.py --w1 --steps 40 --rounds 1   # the embedded default (W1 `add`, eval every
                                                # 10 steps of its held-out set), writes eval_overlap_w1.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETTINGS = {"blocking": True, "non_blocking": False}


class TimedLearner:
    """The learner pool's handle, with each step's (start, end) in `time.perf_counter()` kept in `steps`."""

    def __init__(self, inner):
        self.inner, self.steps, self._began = inner, [], 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start_step(self, *args, **kwargs):
        self._began = time.perf_counter()
        return self.inner.start_step(*args, **kwargs)

    def finish_step(self, step):
        stats = self.inner.finish_step(step)
        self.steps.append((self._began, time.perf_counter()))
        return stats


def run_config(blocking: bool, args, out_dir: Path, model_dir: Path):
    from asyncrl.config import load_config

    if args.w1:  # the embedded default (W1 `add`, add-1m with its warm start), shortened
        overrides = {"output_dir": str(out_dir), "learner.max_steps": args.steps, "learner.compile": False,
                     "eval.blocking": blocking, "telemetry.progress": False, "checkpoint.export_hf": False}  # fmt: skip
        return load_config("default", [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    overrides = {
        "mode": "streaming",
        "output_dir": str(out_dir),
        "model.path": str(model_dir),
        "model.warm_start_examples": 0,
        "data.eval_prompts": args.eval_prompts,
        "rollout.num_workers": 1,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": args.max_tokens,
        "rollout.max_model_len": 512,
        "buffer.filter_zero_variance": False,
        "buffer.log_parquet": False,
        "learner.prompts_per_step": 8,
        "learner.max_steps": args.steps,
        "learner.compile": False,
        "weight_sync.parity_probe": False,
        "eval.every_steps": args.eval_every,
        "eval.temperature": 1.0,
        "eval.samples": args.eval_samples,
        "eval.blocking": blocking,
        "telemetry.progress": False,
        "checkpoint.export_hf": False,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def overlap(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Seconds of `intervals` inside `windows` (each list disjoint within itself)."""
    return sum(max(0.0, min(e, we) - max(b, wb)) for b, e in intervals for wb, we in windows)


def run_one(name: str, args, out_dir: Path, model_dir: Path) -> dict:
    from asyncrl.controller.loop import Controller

    cfg = run_config(SETTINGS[name], args, out_dir, model_dir)
    if args.w1:
        from asyncrl.envs.model_dir import ensure_model

        model_dir = ensure_model(cfg)  # add-1m with its warm start (cached after the first run)
    load_start = common.load_average()
    controller = Controller(cfg, model_dir)
    try:
        controller.start()
        learner = controller.fleet.learner = TimedLearner(controller.fleet.learner)
        summary = controller.run()
    finally:
        controller.shutdown()
    started = controller.state.started
    busy = [(b - started, e - started) for b, e in learner.steps]
    evals = summary["evals"]
    mid = [e for e in evals if 0 < e["step"] < args.steps]
    windows = [(e["wall_s"] - e["eval_s"], e["wall_s"]) for e in mid]
    window_s = sum(e - b for b, e in windows)
    busy_s, wall = sum(e - b for b, e in busy), summary["wall_clock_s"]
    return {
        "setting": name,
        "wall_s": wall,
        "steps": summary["steps"],
        "steps_per_s": summary["steps"] / wall,
        "evaluations": len(evals),
        "mid_run_evaluations": len(mid),
        "eval_window_s": round(window_s, 2),
        "learner_busy_in_windows_s": round(overlap(busy, windows), 2),
        "learner_idle_during_eval": 1 - overlap(busy, windows) / window_s if window_s else None,
        "learner_idle_overall": 1 - busy_s / wall,
        "eval_wait_s": summary["eval_wait_s"],
        "mid_run_eval_wait_s": round(sum(e["eval_wait_s"] for e in mid), 2),
        "eval_s_mean": sum(e["eval_s"] for e in mid) / len(mid) if mid else None,
        "step_s_mean": busy_s / len(busy) if busy else None,
        "publishes_deferred": summary["publishes_deferred"],
        "evals_straddled": summary["evals_straddled"],
        "final_version": summary["final_version"],
        "final_accuracy": summary["final_accuracy"],
        "evals": [{k: e[k] for k in ("step", "version", "recorded_at_step", "accuracy", "eval_s", "eval_wait_s", "straddled")}
                  for e in evals],
        "load_average_1min_start": load_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_options(parser, "eval_overlap", "smoke size: 8 steps, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--w1", action="store_true", help="the embedded default recipe (W1) for --steps steps instead")
    parser.add_argument("--order", default="blocking,non_blocking", help="the settings' order within a round")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.eval_every, args.eval_prompts = 1, 8, 4, 64
    common.set_runtime_env()
    import ray

    from asyncrl.models import build_model

    load_start = common.load_average()
    rows = []
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-eval-overlap-") as tmp:
            model_dir = build_model("tiny-0.3m", Path(tmp) / "model", seed=args.seed)
            for round_index in range(args.rounds):
                for name in args.order.split(","):
                    row = run_one(name, args, Path(tmp) / f"{name}-{round_index}", model_dir)
                    row["round"] = round_index
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "evals"}))
    finally:
        ray.shutdown()
    result = {
        "benchmark": "eval_overlap",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": common.machine(load_start),
        "args": vars(args) | {"out": str(args.out) if args.out else None},
        "rows": rows,
    }
    common.write_json(common.output_path("eval_overlap_w1" if args.w1 else "eval_overlap", args), result)
    print(f"{'setting':<13} {'round':>5} {'idle in eval':>12} {'idle overall':>12} {'eval wait s':>11} {'wall s':>7} {'steps/s':>7}")
    for r in rows:
        print(f"{r['setting']:<13} {r['round']:>5} {r['learner_idle_during_eval']:>12.3f} {r['learner_idle_overall']:>12.3f} "
              f"{r['eval_wait_s']:>11.1f} {r['wall_s']:>7.1f} {r['steps_per_s']:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
