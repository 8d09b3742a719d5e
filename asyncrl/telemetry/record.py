"""A run's telemetry as a list of plain records: what the dashboard page plots, live or from a run folder.

Every telemetry event becomes one `Record(kind, data)` (kinds: step, eval, sync, pool, note, alarm, phase,
close). The live dashboard keeps them in a `RunLog`; `EventLog` appends all but the step rows (which
`metrics.jsonl` already holds) to `<output_dir>/events.jsonl` as they happen, so a crashed run keeps its
evaluations, alarms and notes and `asyncrl dash RUN_DIR` (`load_run`) rebuilds the same `RunLog` from the files.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.redaction import redact, scrub
from asyncrl.telemetry.sinks import AlarmEvent, PoolSnapshot, Sink, SyncEvent

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Record:
    kind: str
    data: dict[str, Any]


def pool_point(snapshot: PoolSnapshot) -> dict[str, Any]:
    """A snapshot flattened to the figures the page plots. Fractions and rates are over the run so far (the
    snapshot's counters are cumulative); the `*_window` idle fractions are over the last `telemetry.rate_window_s`
    (what the alarms and `rollout.autoscale` read), when measured; `queue/*`, `pool/*` and `engine_version/*` keep
    every numeric key, so figures other engineers add to the snapshot show up without a change here."""
    wall = snapshot.wall_s
    busy, idle = snapshot.engine_total("busy_s"), snapshot.engine_total("idle_s")
    learner_idle = min(1.0, snapshot.learner_wait_s / wall) if wall > 0 else None
    point: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "version": snapshot.version,
        "rollout_tokens_per_s": snapshot.engine_total("tokens_generated") / wall if wall > 0 else None,
        "learner_tokens_per_s": snapshot.tokens_trained / wall if wall > 0 else None,
        "rollout_busy_fraction": busy / (busy + idle) if busy + idle > 0 else None,
        "learner_idle_fraction": learner_idle,
        "learner_busy_fraction": None if learner_idle is None else 1.0 - learner_idle,
    }
    if snapshot.live is not None:
        point["learner_idle_window"] = snapshot.live.learner_idle_fraction
        point["rollout_idle_window"] = snapshot.live.rollout_idle_fraction
    point.update({f"queue/{k}": v for k, v in snapshot.queue.items() if isinstance(v, (int, float))})
    point.update({f"pool/{k}": v for k, v in snapshot.pool_sizes.items()})
    point.update({f"engine_version/{name}": e["version"] for name, e in snapshot.engines.items() if "version" in e})
    return point


class Recorder(Sink):
    """Turns each telemetry event into a `Record` and hands it to `record`; subclasses decide where it goes."""

    def record(self, rec: Record) -> None:
        raise NotImplementedError

    def _stamped(self, kind: str, **data: Any) -> None:
        self.record(Record(kind, {"time": time.time(), **data}))

    def phase(self, text: str) -> None:
        self._stamped("phase", text=text)

    def note(self, text: str) -> None:
        self._stamped("note", text=text)

    def alarm(self, event: AlarmEvent) -> None:
        self._stamped("alarm", **asdict(event))

    def step(self, row: dict[str, Any]) -> None:
        self.record(Record("step", row))

    def eval(self, record: dict[str, Any]) -> None:
        self.record(Record("eval", record))

    def sync(self, event: SyncEvent) -> None:
        self.record(Record("sync", asdict(event)))

    def pool(self, snapshot: PoolSnapshot) -> None:
        self.record(Record("pool", pool_point(snapshot)))

    def close(self, summary: dict[str, Any]) -> None:
        self._stamped("close", steps=summary.get("steps"), error=summary.get("error"))


class RunLog:
    """The records of one run in arrival order, numbered from 1 so that a page can ask for what is new."""

    def __init__(self, title: str, live: bool):
        self.title = title
        self.live = live
        self._records: list[Record] = []
        self._lock = threading.Lock()  # the run appends, the page's HTTP thread reads

    def append(self, rec: Record) -> None:
        with self._lock:
            self._records.append(rec)

    def since(self, seq: int) -> dict[str, Any]:
        """Records after number `seq` (JSON-able): {"title", "live", "seq": the last number, "records": [...]}."""
        with self._lock:
            new = self._records[max(0, seq) :]
            last = len(self._records)
        records = [{"seq": seq + 1 + i, "kind": r.kind, "data": r.data} for i, r in enumerate(new)]
        return {"title": self.title, "live": self.live, "seq": last, "records": records}


class EventLog(Recorder):
    """Appends every record but the step rows to `events.jsonl`, line by line (flushed: a crash keeps them),
    secrets redacted (`asyncrl.redaction`: secret-named keys, and the environment's secret values in text)."""

    def __init__(self, out: Path, append: bool = False):
        self.path = Path(out) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append:  # a resumed run goes on appending, as metrics.jsonl does
            self.path.write_text("")

    def record(self, rec: Record) -> None:
        if rec.kind == "step":
            return
        with open(self.path, "a") as f:
            f.write(scrub(json.dumps(redact({"kind": rec.kind, "data": rec.data}))) + "\n")


def load_run(run_dir: Path) -> RunLog:
    """A finished (or crashed) run's `RunLog` from its `metrics.jsonl` and `events.jsonl`; a torn last line
    (the process died while writing it) is skipped."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE} (not an asyncrl run folder?)")
    log = RunLog(run_dir.name, live=False)
    for row in _json_lines(run_dir / EVENTS_FILE):
        log.append(Record(row["kind"], row["data"]))
    for row in _json_lines(run_dir / METRICS_FILE):
        log.append(Record("step", row))
    return log


def _json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
