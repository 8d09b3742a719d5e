"""Soak: a long W1 run under periodic real faults of every kind, and what it lost (nothing, if it works).

    python benchmarks/soak.py [--minutes 20] [--quick] [--out PATH]

The run is cut into legs of `asyncrl run` processes that resume each other from the latest checkpoint. Inside
a leg, the config's fault hooks SIGKILL a rollout engine every `--kill-every` steps (while it loads weights)
and give a batch a NaN reward every `--nan-every` steps. Legs end alternately with SIGTERM (a clean stop) and
SIGKILL of the driver (a crash, resumed from the last periodic checkpoint). Reported, from the runs' own
summaries and trajectory logs: faults injected and survived, prompts lost and samples trained twice (both must
be 0), trained samples/s before and after each engine kill, and the recovery times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

KILL_EVERY, NAN_EVERY = 25, 40


def main() -> None:
    args = _parse()
    common.set_runtime_env()
    load_start = common.load_average()
    out = Path(tempfile.mkdtemp(prefix="asyncrl-soak-")) / "run"
    legs = _run_legs(out, args)
    result = {"machine": common.machine(load_start), "minutes": args.minutes, "legs": legs, **_analyse(out, legs)}
    common.write_json(common.output_path("soak", args), result)
    _print(result)
    if result["prompts_lost"] or result["trained_twice"]:
        sys.exit("soak: samples were lost or trained twice")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock of the whole soak")
    parser.add_argument("--leg-minutes", type=float, default=5.0, help="length of one leg before its SIGTERM/SIGKILL")
    common.add_output_options(parser, "soak", "2 short legs (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.leg_minutes = 2.0, 1.0
    return args


def _overrides(out: Path, step: int) -> list[str]:
    """The default W1 recipe with periodic checkpoints and fault hooks at steps after `step` (a resumed leg)."""
    kills = list(range(step + KILL_EVERY, step + 1_000, KILL_EVERY))
    nans = list(range(step + NAN_EVERY, step + 1_000, NAN_EVERY))
    return [
        f"output_dir={out}", "learner.max_steps=1000000", "checkpoint.every_steps=10", "eval.every_steps=0",
        "weight_sync.parity_probe=false", f"faults.kill_rollout_worker_at_steps={kills}", f"faults.nan_reward_at_steps={nans}",
        *(["checkpoint.resume_from=latest"] if step else []),
    ]


def _run_legs(out: Path, args: argparse.Namespace) -> list[dict]:
    """Run `asyncrl run` legs until `--minutes` are spent; alternate SIGTERM and SIGKILL to end them."""
    legs, deadline, step = [], time.monotonic() + args.minutes * 60, 0
    while time.monotonic() < deadline:
        ending = signal.SIGTERM if len(legs) % 2 == 0 else signal.SIGKILL
        marker = f"{out.parent}/ray-{len(legs)}"
        env = dict(os.environ, RAY_TMPDIR=marker)
        began = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", *_overrides(out, step)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(max(5.0, min(args.leg_minutes * 60, deadline - time.monotonic())))
        proc.send_signal(ending)
        code = proc.wait(timeout=300)
        from asyncrl.testing import kill_processes_with_env

        kill_processes_with_env(marker)  # a crashed driver leaves Ray's processes behind, as on a real node
        for name in ("summary", "metrics"):  # each leg's own (a crashed leg has no summary)
            path = out / f"{name}.json{'l' if name == 'metrics' else ''}"
            if path.exists():
                path.rename(out / f"{name}.leg-{len(legs)}{path.suffix}")
        step = _last_checkpoint_step(out)
        legs.append({"ended_by": ending.name, "exit_code": code, "seconds": round(time.monotonic() - began, 1), "resumable_at_step": step})
    return legs


def _last_checkpoint_step(out: Path) -> int:
    done = [int(f.name.split("-")[1]) for f in (out / "checkpoints").glob("step-*") if (f / "learner_state.json").is_file()]
    return max(done, default=0)


def _analyse(out: Path, legs: list[dict]) -> dict:
    """Faults and their recoveries from the clean legs' summaries; duplication from each leg's trajectory log
    (a crashed leg's training after its last checkpoint is rolled back and redone, so only duplicates within
    one leg are errors); lost samples from the conservation counters of the last clean leg (cumulative)."""
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("summary.leg-*.json"), key=lambda p: int(p.stem.split("-")[-1]))]
    faults = [f for s in summaries for f in s.get("faults", [])]
    twice, trained, cut = _trained_twice(out)
    around = [_throughput_around(out, leg, f["step"]) for leg in range(len(legs)) for f in _leg_faults(out, leg)]
    return {
        "engine_kills": len(faults),
        "engine_kills_recovered": sum(1 for f in faults if f["recovered_s"] is not None),
        "recovery_s": [f["recovered_s"] for f in faults],
        "detection_s": [f["detected_s"] for f in faults],
        "skipped_nan_steps": sum(s.get("skipped_steps", 0) for s in summaries),
        "driver_crashes_resumed": sum(1 for leg in legs[:-1] if leg["ended_by"] == "SIGKILL"),
        "trained_twice": twice,
        "prompts_lost": _lost(summaries[-1]) if summaries else None,
        "trained_samples": trained,
        "logs_cut_by_a_crash": cut,
        "samples_per_s_before_after_kill": around,
    }


def _leg_faults(out: Path, leg: int) -> list[dict]:
    path = out / f"summary.leg-{leg}.json"
    return json.loads(path.read_text()).get("faults", []) if path.exists() else []


def _throughput_around(out: Path, leg: int, step: int, window: int = 10) -> dict:
    """Trained samples/s over the `window` steps before an engine kill at `step` and the `window` after it."""
    rows = [json.loads(line) for line in (out / f"metrics.leg-{leg}.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows}

    def rate(first: int, last: int) -> float | None:
        span = [by_step[s] for s in range(first, last + 1) if s in by_step]
        if len(span) < 2:
            return None
        seconds = span[-1]["wall_s"] - span[0]["wall_s"]
        return round(sum(r["samples"] for r in span[1:]) / seconds, 1) if seconds > 0 else None

    return {"step": step, "before": rate(step - window, step), "after": rate(step, step + window)}


def _trained_twice(out: Path) -> tuple[int, int, int]:
    """(samples trained twice within one leg, samples trained, logs a crash left unreadable)."""
    import pyarrow.parquet as pq

    twice = trained = cut = 0
    for path in sorted(out.glob("trajectories*.parquet")):
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception:  # the driver was SIGKILLed before the Parquet footer was written
            cut += 1
            continue
        ids = [(r["group_id"], r["sample_index"]) for r in rows if r["fate"] == "trained"]
        twice += len(ids) - len(set(ids))
        trained += len(ids)
    return twice, trained, cut


def _lost(summary: dict) -> int:
    """Samples dispatched but in no terminal state nor in flight (conservation; the counters are cumulative)."""
    c = summary["counters"]
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    return c["dispatched"] - ended


def _print(result: dict) -> None:
    print(f"soak {result['minutes']} min, {len(result['legs'])} legs ({', '.join(leg['ended_by'] for leg in result['legs'])})")
    for key in ("engine_kills", "engine_kills_recovered", "skipped_nan_steps", "driver_crashes_resumed", "prompts_lost", "trained_twice", "trained_samples"):
        print(f"  {key:24s} {result[key]}")
    print(f"  recovery s               {result['recovery_s']}")


if __name__ == "__main__":
    main()
