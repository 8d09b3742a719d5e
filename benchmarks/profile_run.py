"""Where the time goes in a run: py-spy samples every process of a live `asyncrl run` at once.

Starts `asyncrl run CONFIG [overrides]`, waits for training to be under way, then records each process
(driver, ReplayQueue, RolloutWorker, vLLM engine core and its model worker, LearnerWorker) with `py-spy record --format raw`
for `--duration` seconds, concurrently, together with its CPU share. Prints, per process, the CPU share
and the frames with the largest inclusive and self sample fractions; writes benchmarks/results/profile.json.
Needs `py-spy` (the `bench` extra) and permission to ptrace the run's processes (root, or
kernel.yama.ptrace_scope=0).

    python benchmarks/profile_run.py [--config configs/default.yaml] [--delay 70] [--duration 20] [override ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
# Process titles set by Ray (`ray::<Actor>`) and vLLM (`VLLM::EngineCore`); the driver is `asyncrl run`.
# On CPU vLLM 0.32 runs the model in a child of the engine core (`VLLM::Worker`, multiprocess executor).
ROLES = {
    "ReplayQueue": "ray::ReplayQueue",
    "RolloutWorker": "ray::RolloutWorker",
    "EngineCore": "VLLM::EngineCore",
    "EngineWorker": "VLLM::Worker",
    "LearnerWorker": "ray::LearnerWorker",
}


def find_processes(driver_pid: int) -> dict[str, int]:
    import psutil

    found = {"driver": driver_pid}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        for role, prefix in ROLES.items():
            if title.startswith(prefix) and role not in found:
                found[role] = proc.info["pid"]
    return found


def summarize(raw: Path, top: int) -> dict:
    """Inclusive and self fractions per frame ("function (file)") from py-spy's collapsed-stack output."""
    inclusive, self_ = collections.Counter(), collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        self_[frames[-1]] += n
    def fractions(counter, skip_roots: bool) -> list:
        # Frames on (nearly) every stack are process/thread bootstrap: they say nothing about where time goes.
        rows = [[k, round(v / total, 3)] for k, v in counter.most_common() if not (skip_roots and v / total > 0.9)]
        return rows[:top]

    return {"samples": total, "inclusive": fractions(inclusive, True) if total else [], "self": fractions(self_, False) if total else []}


def _frame(raw: str) -> str:
    """'func (/long/path/pkg/file.py:123)' -> 'func (pkg/file.py)'."""
    if "(" not in raw:
        return raw
    name, _, where = raw.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(path).parts[-2:])})"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--delay", type=float, default=70.0, help="seconds after launch before sampling (startup)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of sampling")
    parser.add_argument("--top", type=int, default=15, help="frames listed per process")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for the run")
    return parser.parse_args()


def sample_run(args, out: Path) -> dict[str, float]:
    """Starts the run, records each of its processes with py-spy into `out/<role>.txt` once training is
    under way, and stops the run; returns the cores each process used while sampled."""
    cli = str(Path(sys.executable).with_name("asyncrl"))
    run = subprocess.Popen([cli, "run", args.config, f"output_dir={out / 'run'}", "telemetry.progress=false", *args.overrides],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(args.delay)
        if run.poll() is not None:
            raise SystemExit(f"the run ended (rc {run.returncode}) before sampling started; lower --delay or raise learner.max_steps")
        return record_processes(find_processes(run.pid), args.duration, out)
    finally:
        os.killpg(run.pid, 15)
        run.wait(timeout=60)


def record_processes(pids: dict[str, int], duration: float, out: Path) -> dict[str, float]:
    """py-spy on every process at once for `duration` seconds; the cores each used meanwhile."""
    import psutil

    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    procs = {role: psutil.Process(pid) for role, pid in pids.items()}
    for p in procs.values():
        p.cpu_percent(None)
    recorders = {
        role: subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(int(duration)), "--format", "raw",
                                "--nonblocking", "-o", str(out / f"{role}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for role, pid in pids.items()
    }
    for r in recorders.values():
        r.wait(timeout=duration + 60)
    return {role: round(p.cpu_percent(None) / 100, 2) for role, p in procs.items()}  # cores used while sampled


def print_report(report: dict, top: int) -> None:
    print(f"\nprofile of {Path(report['config']).name} {' '.join(report['overrides'])} over {report['duration_s']:.0f}s (cores = CPU time / wall time)")
    for role, r in report["processes"].items():
        print(f"\n== {role}: {r['cpu_cores']:.2f} cores, {r['samples']} samples")
        for frame, f in r.get("inclusive", [])[:top]:
            print(f"  {f:6.1%}  {frame[:110]}")
        if r.get("self"):
            print("  -- self")
            for frame, f in r["self"][:6]:
                print(f"  {f:6.1%}  {frame[:110]}")


def main() -> None:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="profile-"))
    cpu = sample_run(args, out)
    report = {"config": args.config, "overrides": args.overrides, "duration_s": args.duration, "processes": {}}
    for role, cores in cpu.items():
        raw = out / f"{role}.txt"
        report["processes"][role] = {"cpu_cores": cores, **(summarize(raw, args.top) if raw.exists() else {"samples": 0})}
    print_report(report, args.top)
    common.write_json(common.RESULTS / "profile.json", report)


if __name__ == "__main__":
    main()
