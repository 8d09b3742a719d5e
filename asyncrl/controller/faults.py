"""Fault injection (`faults.*` config) and what the run does and reports about faults it lived through.

Injected faults are real: a rollout worker's process gets SIGKILL, exactly what an OOM kill or a lost node
does to it; a NaN reward goes through the learner's real step.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.types import Batch


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient (`learner.max_skipped_steps`)."""


def poison_batch(batch: Batch, poison: bool) -> None:
    """`faults.nan_reward_at_steps`: give the batch's first trajectory a NaN reward."""
    if poison:
        batch.groups[0].trajectories[0].reward = float("nan")


def write_bad_batch(out: Path, step: int, batch: Batch) -> Path:
    """Keep a skipped step's batch as `<out>/bad_batches/step-NNNNNN.parquet` (the trajectory log's schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.buffer.storage import trajectories_to_arrow

    path = out / "bad_batches" / f"step-{step:06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = trajectories_to_arrow([t for g in batch.groups for t in g.trajectories])
    pq.write_table(pa.Table.from_batches([rows]), path)
    return path


def chaos_schedule(chaos: Any, max_steps: int, excluded: Sequence[int] = ()) -> dict[int, str]:
    """`faults.chaos` as {step: "kill" | "stop"}: distinct random steps in [first_step, last_step] (last 0:
    `max_steps`) outside `excluded`, the kinds shuffled over them; raises naming the keys when they do not fit."""
    kinds = ["kill"] * chaos.kills + ["stop"] * chaos.stops
    if not kinds:
        return {}
    last = chaos.last_step or max_steps
    steps = [s for s in range(chaos.first_step, last + 1) if s not in set(excluded)]
    if len(steps) < len(kinds):
        raise ValueError(
            f"faults.chaos: {len(kinds)} faults (kills + stops) do not fit on the {len(steps)} free steps "
            f"from first_step = {chaos.first_step} to {last}"
        )
    rng = random.Random(chaos.seed)
    rng.shuffle(kinds)
    return dict(zip(sorted(rng.sample(steps, len(kinds))), kinds, strict=True))


def signal_worker(pid: int, kind: str) -> list[int]:
    """`kill`: SIGKILL the worker's process; `stop`: SIGSTOP it and every process under it (its engine core),
    children first. -> the pids signalled."""
    import psutil

    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
        return [pid]
    worker = psutil.Process(pid)
    pids = [p.pid for p in worker.children(recursive=True)] + [pid]
    for each in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGSTOP)
    return pids


def end_stopped(pids: Sequence[int]) -> None:
    """SIGKILL processes that fault injection stopped (a stopped process never notices its parent died)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def recovery_timings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each `killed` event: seconds until the pool noticed (`died`) and until the replacement served the
    latest weights (`joined`), from the controller's pool events (each with `t_s`, `worker`, `kind`)."""
    out = []
    for killed in (e for e in events if e["kind"] == "killed"):
        died = next(
            (
                e
                for e in events
                if e["kind"] == "died" and e["worker"] == killed["worker"] and e["t_s"] >= killed["t_s"]
            ),
            None,
        )
        joined = None
        if died is not None and died.get("replacement"):
            joined = next((e for e in events if e["kind"] == "joined" and e["worker"] == died["replacement"]), None)
        out.append(
            {
                "worker": killed["worker"],
                "step": killed["step"],
                "detected_s": round(died["t_s"] - killed["t_s"], 3) if died else None,
                "recovered_s": round(joined["t_s"] - killed["t_s"], 3) if joined else None,
                "requeued": died["requeued"] if died else None,
            }
        )
    return out


def scaling_timings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each worker added by `asyncrl scale`: seconds from the request to the worker serving the latest
    weights, and the version it joined at."""
    out = []
    for up in (e for e in events if e["kind"] == "scaled_up"):
        joined = next((e for e in events if e["kind"] == "joined" and e["worker"] == up["worker"]), None)
        out.append(
            {
                "worker": up["worker"],
                "requested_at_version": up["version"],
                "joined_version": joined["version"] if joined else None,
                "request_to_serving_s": round(joined["wall"] - up["requested_at"], 3)
                if joined and up["requested_at"]
                else None,
            }
        )
    return out


def learner_scaling_timings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each learner resize (`asyncrl scale JOB learner=N`): the ranks before and after, the checkpoint and
    re-forming seconds, and the seconds from the request to the end of the first step on the new pool."""
    out = []
    for i, resized in enumerate(events):
        if resized["kind"] != "learner_resized":
            continue
        first = next((e for e in events[i + 1 :] if e["kind"] == "learner_first_step"), None)
        requested = resized.get("requested_at")
        out.append(
            {
                "from_ranks": resized["from_ranks"],
                "ranks": resized["ranks"],
                "step": resized["step"],
                "version": resized["version"],
                "checkpoint_s": resized["checkpoint_s"],
                "reform_s": resized["reform_s"],
                "request_to_first_step_s": round(first["wall"] - requested, 3) if first and requested else None,
            }
        )
    return out
