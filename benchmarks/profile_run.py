"""Where the time goes in a run: py-spy samples every process of a live `asyncrl run` at once.

Starts `asyncrl run CONFIG [overrides]`, waits for training to be under way (`--delay` seconds and
`--min-steps` steps logged), then records each process
(driver, ReplayQueue, RolloutWorker, vLLM engine core and its model worker, LearnerWorker) with `py-spy record --format raw`
for `--duration` seconds, concurrently, together with its CPU share. Prints, per process, the CPU share (in all
and per thread: py-spy's samples cannot tell a thread blocked in native code from a busy one, /proc can) and
the frames with the largest inclusive and self sample fractions, and the whole machine's busy, idle and stolen
cores; writes benchmarks/results/profile.json (`--out`).
Needs `py-spy` (the `bench` extra) and permission to ptrace the run's processes (root, or
kernel.yama.ptrace_scope=0).

    python benchmarks/profile_run.py [--config configs/default.yaml] [--delay 70] [--duration 20] [--label L] [--out F] [override ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
# Process titles set by Ray (`ray::<Actor class>`) and vLLM (`VLLM::EngineCore`); the driver is `asyncrl run`.
# The pools run node-local subclasses (`NodeLocalRolloutWorker`, `NodeLocalLearnerWorker`), so a role matches
# the class name with or without that prefix. On CPU vLLM 0.32 runs the model in a child of the engine core
# (`VLLM::Worker`, multiprocess executor).
ROLES = {
    "ReplayQueue": ("ray::ReplayQueue",),
    "RolloutWorker": ("ray::RolloutWorker", "ray::NodeLocalRolloutWorker"),
    "EngineCore": ("VLLM::EngineCore",),
    "EngineWorker": ("VLLM::Worker",),
    "LearnerWorker": ("ray::LearnerWorker", "ray::NodeLocalLearnerWorker"),
}


def find_processes(driver_pid: int) -> dict[str, int]:
    """The run's processes by role: only the driver's descendants (its Ray node started them), so another
    run on the same machine is never sampled."""
    import psutil

    found = {"driver": driver_pid}
    for proc in psutil.Process(driver_pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for role, prefixes in ROLES.items():
            if title.startswith(prefixes) and role not in found:
                found[role] = proc.pid
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
    parser.add_argument("--min-steps", type=int, default=5, help="and not before the run has taken this many steps")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of sampling")
    parser.add_argument("--top", type=int, default=15, help="frames listed per process")
    parser.add_argument("--label", default="", help="what this profile is of (e.g. 'before <change>'), shown by report.py")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "profile.json", help="result JSON")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for the run")
    return parser.parse_args()


def sample_run(args, out: Path) -> tuple[dict[str, float], dict[str, list], dict[str, float], int]:
    """Starts the run, records each of its processes with py-spy into `out/<role>.txt` once training is
    under way, and stops the run; returns the cores each process used while sampled and the samples the
    learner trained meanwhile (a loaded machine trains fewer: CPU per trained sample compares runs)."""
    cli = str(Path(sys.executable).with_name("asyncrl"))
    run = subprocess.Popen([cli, "run", args.config, f"output_dir={out / 'run'}", "telemetry.progress=false", *args.overrides],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(args.delay)
        metrics = out / "run" / "metrics.jsonl"
        wait_for_steps(run, metrics, args.min_steps)
        before = len(metrics.read_text().splitlines())
        cores, threads, machine = record_processes(find_processes(run.pid), args.duration, out)
        lines = metrics.read_text().splitlines()[before:]
        return cores, threads, machine, sum(json.loads(line).get("samples", 0) for line in lines)
    finally:
        stop_run(run)


def wait_for_steps(run: subprocess.Popen, metrics: Path, min_steps: int, timeout_s: float = 900.0) -> None:
    """Until the run has logged `min_steps` optimizer steps (one metrics line each): on a loaded machine start-up
    alone can outlast `--delay`, and a profile of start-up says nothing about training."""
    deadline = time.monotonic() + timeout_s
    while not metrics.exists() or len(metrics.read_text().splitlines()) < min_steps:
        if run.poll() is not None:
            raise SystemExit(f"the run ended (rc {run.returncode}) before sampling started; raise learner.max_steps")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {min_steps} training steps within {timeout_s:.0f}s")
        time.sleep(1.0)


def stop_run(run: subprocess.Popen) -> None:
    """SIGTERM to the driver alone, which stops the run at its next step and shuts every actor down in order
    (a learner rank killed by a group-wide signal would leave its shared-memory segments behind); SIGKILL to the
    whole group if it has not ended a minute later (a loaded machine can hold up Ray's shutdown): the figures
    already taken must not be lost to a slow exit. Descendants in other process groups (vLLM's engine core
    starts its own) that outlive the run are killed too."""
    import psutil

    descendants = psutil.Process(run.pid).children(recursive=True)
    run.send_signal(signal.SIGTERM)
    try:
        run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    _, alive = psutil.wait_procs(descendants, timeout=10)
    for proc in alive:
        proc.kill()


def record_processes(pids: dict[str, int], duration: float, out: Path) -> tuple[dict[str, float], dict[str, list], dict[str, float]]:
    """py-spy on every process at once for `duration` seconds; the cores each used meanwhile, in all and per
    thread name, and the whole machine's (`machine_times`)."""
    import psutil

    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    procs = {role: psutil.Process(pid) for role, pid in pids.items()}
    for p in procs.values():
        p.cpu_percent(None)
    threads_before = {role: thread_times(pid) for role, pid in pids.items()}
    machine_before = machine_times()
    recorders = {
        role: subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(int(duration)), "--format", "raw",
                                "--nonblocking", "-o", str(out / f"{role}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for role, pid in pids.items()
    }
    for r in recorders.values():
        r.wait(timeout=duration + 60)
    cores = {role: round(p.cpu_percent(None) / 100, 2) for role, p in procs.items()}  # cores used while sampled
    threads = {role: thread_cores(threads_before[role], thread_times(pid), duration) for role, pid in pids.items()}
    machine = {k: round((v - machine_before[k]) / duration, 3) for k, v in machine_times().items()}
    return cores, threads, machine


def machine_times() -> dict[str, float]:
    """The whole machine's CPU seconds so far (/proc/stat): busy (user, nice, system, irq, softirq), idle
    (with iowait) and steal (taken by the hypervisor): cores busy in the run next to the cores there were."""
    ticks = [int(x) / os.sysconf("SC_CLK_TCK") for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return {"busy_cores": user + nice + system + irq + softirq, "idle_cores": idle + iowait, "steal_cores": steal}


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each of a process's threads, with the thread's name (Linux: /proc/PID/task)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        times[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return times


def thread_cores(before: dict, after: dict, duration: float) -> list:
    """Cores per thread name over the sampling window, busiest first: which threads a process's CPU goes to
    (Ray's core-worker threads are named, Python threads carry the process title)."""
    by_name = collections.Counter()
    for tid, (name, seconds) in after.items():
        by_name[name] += seconds - before.get(tid, (name, 0.0))[1]
    return [[name, round(s / duration, 3)] for name, s in by_name.most_common() if s > 0]


def print_report(report: dict, top: int) -> None:
    print(f"\nprofile of {Path(report['config']).name} {' '.join(report['overrides'])} over {report['duration_s']:.0f}s (cores = CPU time / wall time)")
    if report.get("machine_cores"):
        print("machine: " + ", ".join(f"{k} {v:.2f}" for k, v in report["machine_cores"].items()))
    for role, r in report["processes"].items():
        per_sample = f", {r['cpu_ms_per_trained_sample']:.2f} ms CPU per trained sample" if "cpu_ms_per_trained_sample" in r else ""
        print(f"\n== {role}: {r['cpu_cores']:.2f} cores{per_sample}, {r['samples']} samples")
        if r.get("threads"):
            print("  threads (cores): " + ", ".join(f"{name} {c:.3f}" for name, c in r["threads"][:8]))
        for frame, f in r.get("inclusive", [])[:top]:
            print(f"  {f:6.1%}  {frame[:110]}")
        if r.get("self"):
            print("  -- self")
            for frame, f in r["self"][:6]:
                print(f"  {f:6.1%}  {frame[:110]}")


def main() -> None:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="profile-"))
    load_start = common.load_average()  # the worker's CPU share depends on how busy the machine is
    cpu, threads, machine, trained = sample_run(args, out)
    report = {"config": args.config, "overrides": args.overrides, "label": args.label, "duration_s": args.duration,
              "trained_samples_per_s": trained / args.duration, "machine": common.machine(load_start), "machine_cores": machine,
              "processes": {}}
    for role, cores in cpu.items():
        raw = out / f"{role}.txt"
        per_sample = {"cpu_ms_per_trained_sample": 1000 * cores * args.duration / trained} if trained else {}
        report["processes"][role] = {"cpu_cores": cores, **per_sample, "threads": threads[role], **(summarize(raw, args.top) if raw.exists() else {"samples": 0})}
    print_report(report, args.top)
    common.write_json(args.out, report)


if __name__ == "__main__":
    main()
