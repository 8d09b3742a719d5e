"""Soak: a long W1 run under periodic real faults of every kind, and what it lost (nothing, if it works).

    python benchmarks/soak.py [--minutes 20] [--leg-minutes 5] [--kill-every 4] [--nan-every 6] [--quick] [--out PATH]
    python benchmarks/soak.py --reanalyse benchmarks/results/soak.json   # the analysis again, same run folder

The run is cut into legs of `asyncrl run` processes, each resuming the previous one's latest checkpoint. The
reward is a user `module:function` reward, so every sample is scored on a sandboxed tool worker. Faults:

- inside every leg, the config's fault hooks SIGKILL the rollout engine every `--kill-every` steps (while it
  loads new weights) and give a batch a NaN reward every `--nan-every` steps (the step must be skipped);
- half-way through a leg (once it trains), the soak SIGKILLs a tool worker (even legs) or SIGSTOPs one, so
  that it hangs (odd legs): the tool pool must replace it and the run go on;
- a leg ends, in turn, with SIGTERM to the driver (a clean stop), SIGKILL of the driver (a crash, resumed from
  the last periodic checkpoint) or SIGKILL of the learner rank (the run must stop with an error naming the
  rank, and resume). A leg ends after `--leg-minutes`, once it trained 2 steps after its tool fault.

Reported: faults injected and survived by kind, samples trained twice and lost (both must be 0: the counters'
conservation and the trajectory logs by sample id across legs, `soak_ledger.py`), trained samples/s in the
minute before and after each fault, and the recovery times. `--quick` is a smoke test: one leg of each ending.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import common
import soak_ledger

ENDINGS = ("SIGTERM", "driver SIGKILL", "learner rank SIGKILL")
TOOL_FAULTS = (signal.SIGKILL, signal.SIGSTOP)
USER_REWARD = "asyncrl.envs.rewards:exact_match"
"""The built-in reward named as a user's `module:function`: it then runs on the tool workers, in the sandbox."""
RANK_NAMED = re.compile(r"learner rank \d+: \w+ failed: the rank died")
ENGINE_DIED = re.compile(r"^\[\s*([\d.]+)s\] rollout worker \S+ died: (\d+) requests re-dispatched, replaced by (\S+)", re.M)
"""The driver's log line when its rollout pool noticed a dead engine (seconds since the driver started)."""
TOOL_REPLACED = re.compile(r"tool worker \S+ (died|hung)[^\n]*replaced")
"""The driver's log line when its tool pool replaced a worker."""
EXIT_TIMEOUT_S = 300.0
"""Longest wait for a driver to exit after its SIGTERM or after its learner rank died."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    samples_trained: int


@dataclass
class Leg:
    """One `asyncrl run` process of the soak; times are seconds since the soak began."""

    index: int
    ending: str
    resumed_from: Checkpoint | None
    started_s: float
    tool_fault: dict | None = None
    ended_s: float | None = None
    exit_code: int | None = None
    exited_on_its_own: bool = False
    """The driver exited before its ending was applied: a fault it did not survive."""
    exit_s: float | None = None
    """Seconds from the ending's signal to the driver's exit."""
    rank_named: bool | None = None
    resumable_at: Checkpoint | None = None
    step_seen_s: dict[int, float] = field(default_factory=dict)
    """When the soak first saw each step's metrics row: the run's own `wall_s` starts after its engines do."""


def main() -> None:
    args = _parse()
    result = _reanalysed(args) if args.reanalyse else _soak(args)
    common.write_json(common.output_path("soak", args), result)
    _print(result)
    if result["prompts_lost"] or result["trained_twice"]["by_id"] or result["lost_by_id"]:
        sys.exit("soak: samples were lost or trained twice")


def _soak(args: argparse.Namespace) -> dict:
    common.set_runtime_env()
    load_start = common.load_average()
    out = Path(tempfile.mkdtemp(prefix="asyncrl-soak-")) / "run"
    began = time.monotonic()
    legs = _run_legs(out, args, began)
    return {
        "machine": common.machine(load_start), "minutes": args.minutes, "wall_minutes": round((time.monotonic() - began) / 60, 1),
        "command": " ".join(sys.argv), "kill_every": args.kill_every, "nan_every": args.nan_every, "output_dir": str(out),
        "legs": [asdict(leg) for leg in legs], **_analyse(out, legs, args),
    }  # fmt: skip


def _reanalysed(args: argparse.Namespace) -> dict:
    """A result JSON's analysis done again from its legs and run folder (which must still exist)."""
    result = json.loads(args.reanalyse.read_text())
    args.kill_every, args.nan_every = result.get("kill_every", args.kill_every), result.get("nan_every", args.nan_every)
    legs = [_leg_from_json(leg) for leg in result["legs"]]
    return result | {"kill_every": args.kill_every, "nan_every": args.nan_every} | _analyse(Path(result["output_dir"]), legs, args)


def _leg_from_json(leg: dict) -> Leg:
    checkpoint = {key: Checkpoint(**leg[key]) if leg[key] else None for key in ("resumed_from", "resumable_at")}
    return Leg(**(leg | checkpoint | {"step_seen_s": {int(k): v for k, v in leg["step_seen_s"].items()}}))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock of the whole soak")
    parser.add_argument("--leg-minutes", type=float, default=5.0, help="length of one leg before its ending")
    # A W1 step takes 10-30 s on a loaded 2-core machine with the sandboxed reward, and a leg spends ~2 min starting:
    # a 5-minute leg trains some 6-15 steps.
    parser.add_argument("--kill-every", type=int, default=4, help="SIGKILL the rollout engine after every k steps")
    parser.add_argument("--nan-every", type=int, default=6, help="a NaN reward in every k-th step's batch")
    parser.add_argument("--reanalyse", type=Path, default=None, help="redo the analysis of this result JSON (its run folder must exist)")
    common.add_output_options(parser, "soak", "3 legs of 3.5 min, one of each ending (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.leg_minutes = 10.5, 3.5
    return args


def _overrides(out: Path, args: argparse.Namespace, resume: Checkpoint | None) -> list[str]:
    """The default W1 recipe with a user reward, periodic checkpoints and fault hooks at the steps after the
    checkpoint it resumes from (numbered from the run's first step)."""
    step = resume.step if resume else 0
    kills = list(range(_next_multiple(step, args.kill_every), step + 1_000, args.kill_every))
    nans = list(range(_next_multiple(step, args.nan_every), step + 1_000, args.nan_every))
    return [
        f"output_dir={out}", "learner.max_steps=1000000", "checkpoint.every_steps=5", "eval.every_steps=0",
        f"env.reward={USER_REWARD}", "weight_sync.parity_probe=false",  # the probe would wait for the sync the fault cuts
        f"faults.kill_rollout_worker_at_steps={kills}", f"faults.nan_reward_at_steps={nans}",
        *(["checkpoint.resume_from=latest"] if resume else []),
    ]  # fmt: skip


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


def _run_legs(out: Path, args: argparse.Namespace, began: float) -> list[Leg]:
    """Run whole legs while at least half a leg of `--minutes` is left (a short last leg may never train: a
    loaded machine takes minutes to start one)."""
    legs: list[Leg] = []
    deadline, seconds = began + args.minutes * 60, args.leg_minutes * 60
    while deadline - time.monotonic() > seconds / 2:
        resume = legs[-1].resumable_at if legs else None
        legs.append(_run_leg(out, args, Leg(len(legs), ENDINGS[len(legs) % len(ENDINGS)], resume, time.monotonic() - began), seconds, began))
        print(f"leg {legs[-1].index}: {legs[-1].ending}, exit {legs[-1].exit_code}, resumable at {legs[-1].resumable_at}", flush=True)
    return legs


def _run_leg(out: Path, args: argparse.Namespace, leg: Leg, seconds: float, began: float) -> Leg:
    from asyncrl.testing import kill_processes_with_env

    marker = f"{out.parent}/ray-{leg.index}"
    env = dict(os.environ, RAY_TMPDIR=marker)  # every process of the leg, Ray's included, carries it
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", *_overrides(out, args, leg.resumed_from)]
    with open(out.parent / f"leg-{leg.index}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        # Each fault waits for training to be under way (a loaded machine may take minutes to start a leg),
        # and the ending for 2 steps after the tool fault, so that each fault's aftermath is seen.
        if not _watch(proc, out, leg, began, until=start + seconds / 2, steps=1, hard_until=start + seconds):
            leg.tool_fault = _hit_tool_worker(marker, TOOL_FAULTS[leg.index % 2], time.monotonic() - began)
        steps = len(leg.step_seen_s) + 2
        leg.exited_on_its_own = _watch(proc, out, leg, began, until=start + seconds, steps=steps, hard_until=start + 2 * seconds)
        leg.ended_s = round(time.monotonic() - began, 1)
        if not leg.exited_on_its_own:
            _end(proc, marker, leg)
        _watch(proc, out, leg, began, until=time.monotonic())  # the rows written while it stopped
        leg.exit_code = proc.returncode
    kill_processes_with_env(marker)  # a crashed driver leaves Ray's processes behind, as on a real node
    log_text = (out.parent / f"leg-{leg.index}.log").read_text()
    leg.rank_named = bool(RANK_NAMED.search(log_text)) if "rank" in leg.ending else None
    if leg.tool_fault is not None:
        leg.tool_fault["replaced"] = bool(TOOL_REPLACED.search(log_text))
    _keep_leg_files(out, leg.index)
    leg.resumable_at = _latest_checkpoint(out)
    return leg


def _watch(proc: subprocess.Popen, out: Path, leg: Leg, began: float, until: float, steps: int = 0, hard_until: float = 0.0) -> bool:
    """Note when each new metrics row appears, until `until` (monotonic) once the leg has `steps` rows, or
    `hard_until` regardless; True if the driver exited meanwhile."""
    path = out / "metrics.jsonl"
    while True:
        exited = proc.poll() is not None
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
        for line in lines[len(leg.step_seen_s) :]:
            leg.step_seen_s[json.loads(line)["step"]] = round(time.monotonic() - began, 1)
        now = time.monotonic()
        if exited or (now >= until and (len(leg.step_seen_s) >= steps or now >= hard_until)):
            return exited
        time.sleep(1.0)


def _exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=max(0.0, seconds))
        return True
    except subprocess.TimeoutExpired:
        return False


def _end(proc: subprocess.Popen, marker: str, leg: Leg) -> None:
    """Apply the leg's ending; a driver that does not exit within `EXIT_TIMEOUT_S` of it is SIGKILLed."""
    sent = time.monotonic()
    if leg.ending == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    elif leg.ending == "driver SIGKILL":
        proc.kill()
    else:
        for pid in _actor_pids(marker, "LearnerWorker"):
            os.kill(pid, signal.SIGKILL)
    if not _exited_within(proc, EXIT_TIMEOUT_S):
        proc.kill()
        proc.wait()
    leg.exit_s = round(time.monotonic() - sent, 1)


def _hit_tool_worker(marker: str, sig: signal.Signals, at_s: float) -> dict:
    """SIGKILL or SIGSTOP (a hang: alive, silent) one tool worker of the leg."""
    pids = _actor_pids(marker, "ToolWorker")
    if pids:
        os.kill(pids[0], sig)
    return {"kind": f"tool worker {sig.name}", "at_s": round(at_s, 1), "injected": bool(pids)}


def _actor_pids(marker: str, actor_class: str) -> list[int]:
    """Pids of the leg's Ray actor processes whose class name ends in `actor_class` (Ray titles them
    `ray::<Class>` or `ray::<Class>.<method>`: `ray::NodeLocalLearnerWorker.train_step`)."""
    from asyncrl.testing import processes_with_env

    pids = []
    for pid in processes_with_env(marker):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
            if title.startswith("ray::") and title.split(".")[0].endswith(actor_class):
                pids.append(pid)
        except OSError:
            continue
    return sorted(pid for pid in pids if _parent(pid) not in pids)  # a child forked by the actor keeps its title


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _keep_leg_files(out: Path, index: int) -> None:
    """Rename the leg's summary, metrics and trajectory log to `<name>.leg-<i>.<ext>` (the next leg writes its own)."""
    for name in ("summary.json", "metrics.jsonl", "trajectories.parquet"):
        path = out / name
        if path.exists():
            stem, ext = name.split(".")
            path.rename(out / f"{stem}.leg-{index}.{ext}")


def _latest_checkpoint(out: Path) -> Checkpoint | None:
    """The newest complete checkpoint (`resume_from=latest` picks the same one); None if there is none."""
    extra = _latest_extra(out)
    return Checkpoint(extra["step"], extra["samples_trained"]) if extra else None


def _pending_prompts(out: Path) -> Callable[[str], bool]:
    """Whether a resume from the newest checkpoint would run a prompt: it waits in the queue's backlog, or it
    is not drawn yet (W1 prompt ids are `add-<seed>-<draw index>`; a resume draws on from `prompts_drawn`)."""
    extra = _latest_extra(out) or {"queue": {"backlog": []}, "prompts_drawn": 0}
    backlog = {item["prompt"]["prompt_id"] for item in extra["queue"]["backlog"]}
    return lambda prompt_id: prompt_id in backlog or int(prompt_id.rsplit("-", 1)[1]) >= extra["prompts_drawn"]


def _latest_extra(out: Path) -> dict | None:
    done = sorted(f for f in (out / "checkpoints").glob("step-*") if (f / "learner_state.json").is_file())
    return json.loads((done[-1] / "extra.json").read_text()) if done else None


# ---------------------------------------------------------------------------------------------------- analysis


def _analyse(out: Path, legs: list[Leg], args: argparse.Namespace) -> dict:
    """Faults by kind (injected, survived), recovery, throughput around each fault, and the sample accounting."""
    rows = [_metrics(out, leg) for leg in legs]
    summaries = [_summary(out, leg.index) for leg in legs]  # a crashed leg has none
    faults = [f for leg in legs for f in _leg_faults(leg, rows[leg.index], (out.parent / f"leg-{leg.index}.log").read_text(), args)]
    faults += [_ending_fault(leg, legs[leg.index + 1] if leg.index + 1 < len(legs) else None, rows) for leg in legs]
    ledger = soak_ledger.analyse([_ledger_leg(out, leg) for leg in legs], _pending_prompts(out))
    last = next((s for s in reversed(summaries) if s), None)
    return {
        "faults": faults,
        "faults_by_kind": _by_kind(faults),
        "prompts_lost": _lost(last) if last else None,
        "lost_by_id": ledger.lost,
        "trained_twice": {"by_id": ledger.trained_twice},
        "ledger": asdict(ledger),
        "steps": max((r[-1]["step"] for r in rows if r), default=0),
        "trained_samples": max((leg.resumable_at.samples_trained for leg in legs if leg.resumable_at), default=0),
    }


def _metrics(out: Path, leg: Leg) -> list[dict]:
    """The leg's step rows, each with `t`: when the soak saw it (seconds since the soak began)."""
    path = out / f"metrics.leg-{leg.index}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r | {"t": leg.step_seen_s[r["step"]]} for r in rows if r["step"] in leg.step_seen_s]


def _summary(out: Path, index: int) -> dict | None:
    path = out / f"summary.leg-{index}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _ledger_leg(out: Path, leg: Leg) -> soak_ledger.LegLog:
    start = leg.resumed_from.samples_trained if leg.resumed_from else 0
    end = leg.resumable_at.samples_trained if leg.resumable_at else 0
    return soak_ledger.read_leg(out / f"trajectories.leg-{leg.index}.parquet", start, end)


def _leg_faults(leg: Leg, rows: list[dict], log_text: str, args: argparse.Namespace) -> list[dict]:
    """The engine kills and NaN steps of the leg, and its tool-worker fault."""
    steps = [r["step"] for r in rows]
    first = leg.resumed_from.step if leg.resumed_from else 0
    out = [_engine_kill(leg, rows, died, log_text) for died in ENGINE_DIED.finditer(log_text)]
    for row in (r for r in rows if r["step"] > first and r["step"] % args.nan_every == 0):
        out.append({"kind": "NaN reward", "leg": leg.index, "step": row["step"], "survived": _nan_survived(leg, steps, row)})
    if leg.tool_fault and leg.tool_fault["injected"]:
        out.append(_tool_fault(leg, rows))
    return out


def _nan_survived(leg: Leg, steps: list[int], row: dict) -> bool | None:
    """A NaN step survived when it was skipped and the run went on past it: a later step in this leg, or a
    checkpoint at or after it that the next leg resumes from. None when the leg ended right after it without one
    (the next leg replays that step)."""
    if not row.get("skipped_step"):
        return False
    went_on = steps[-1] > row["step"] or (leg.resumable_at is not None and leg.resumable_at.step >= row["step"])
    return True if went_on else None


def _engine_kill(leg: Leg, rows: list[dict], died: re.Match, log_text: str) -> dict:
    """Survived: the replacement served the latest weights (recovery: seconds from the pool noticing the death
    to that); None when the leg ended first."""
    served = re.search(rf"^\[\s*([\d.]+)s\] rollout worker {re.escape(died[3])} serves", log_text, re.M)
    at = round(leg.started_s + float(died[1]), 1)
    survived = (served is not None and not leg.exited_on_its_own) if served or leg.exited_on_its_own else None
    return {
        "kind": "rollout engine SIGKILL (weight sync)", "leg": leg.index, "at_s": at, "requeued": int(died[2]), "survived": survived,
        "recovery_s": round(float(served[1]) - float(died[1]), 1) if served else None, **_rates(rows, at),
    }  # fmt: skip


def _tool_fault(leg: Leg, rows: list[dict]) -> dict:
    """Survived: the pool replaced the worker (the driver's log says so) and the leg trained on after it."""
    at = leg.tool_fault["at_s"]
    after = [r["t"] for r in rows if r["t"] > at]
    survived = leg.tool_fault["replaced"] and bool(after) and not leg.exited_on_its_own
    return {
        "kind": leg.tool_fault["kind"], "leg": leg.index, "at_s": at, "replaced": leg.tool_fault["replaced"],
        "survived": survived, "recovery_s": round(after[0] - at, 1) if after else None, **_rates(rows, at),
    }  # fmt: skip


def _ending_fault(leg: Leg, next_leg: Leg | None, rows: list[list[dict]]) -> dict:
    """A leg's ending. Survived: it stopped as it should (SIGTERM: exit 0; a learner rank: an error naming the
    rank) and the next leg resumed and trained (recovery: seconds from the signal to its first step); None when
    that is not known (the last leg, or a next leg ended before its first step)."""
    kind = {"SIGTERM": "SIGTERM (clean stop)", "driver SIGKILL": "driver SIGKILL"}.get(leg.ending, "learner rank SIGKILL")
    stopped_right = not leg.exited_on_its_own and leg.rank_named is not False and (leg.ending != "SIGTERM" or leg.exit_code == 0)
    resumed = next_leg is not None and bool(rows[next_leg.index])
    survived: bool | None = stopped_right and resumed
    if stopped_right and not resumed and (next_leg is None or not next_leg.exited_on_its_own):
        survived = None
    recovery = round(rows[next_leg.index][0]["t"] - leg.ended_s, 1) if resumed else None
    return {"kind": kind, "leg": leg.index, "exit_code": leg.exit_code, "exit_s": leg.exit_s, "rank_named": leg.rank_named,
            "survived": survived, "recovery_s": recovery}  # fmt: skip


def _rates(rows: list[dict], at_s: float, window_s: float = 60.0) -> dict:
    """Trained samples/s over the `window_s` before `at_s` (soak time) and the `window_s` after it."""

    def rate(first: float, last: float) -> float | None:
        span = [r for r in rows if first < r["t"] <= last]
        if not span or last > rows[-1]["t"] or first < rows[0]["t"]:
            return None  # the window is not covered by the leg's steps
        return round(sum(r["samples"] for r in span) / (last - first), 1)

    return {"samples_per_s_before": rate(at_s - window_s, at_s), "samples_per_s_after": rate(at_s, at_s + window_s)}


def _by_kind(faults: list[dict]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for f in faults:
        entry = table.setdefault(f["kind"], {"injected": 0, "survived": 0, "not_known": 0})
        entry["injected"] += 1
        entry["survived"] += int(f["survived"] is True)
        entry["not_known"] += int(f["survived"] is None)
    return table


def _lost(summary: dict) -> int:
    """Samples dispatched but in no terminal state nor in flight (conservation; the counters are cumulative)."""
    c = summary["counters"]
    ended = c["trained"] + c["dropped_stale"] + c["in_flight"] + sum(v for k, v in c.items() if k.startswith(("filtered:", "failed:")))
    return c["dispatched"] - ended


def _print(result: dict) -> None:
    legs = result["legs"]
    print(f"soak {result['wall_minutes']} min, {len(legs)} legs ({', '.join(leg['ending'] for leg in legs)}), {result['steps']} steps")
    for kind, n in result["faults_by_kind"].items():
        print(f"  {kind:40s} injected {n['injected']:3d}  survived {n['survived']:3d}  not known {n['not_known']:3d}")
    print(f"  prompts lost (counters) {result['prompts_lost']}, lost by id {result['lost_by_id']}, trained twice {result['trained_twice']['by_id']}")


if __name__ == "__main__":
    main()
