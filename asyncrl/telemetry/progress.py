"""The console view of a run (a telemetry `Sink`).

On a terminal it is one live status block (rich) that redraws in place: the start-up phase with its elapsed
time, then step/max with a bar, version, reward, held-out accuracy, staleness, mismatch, tokens/s and ETA;
phases and notes scroll above it. When stdout is not a terminal (CI, a Ray job's log, a pipe) every step,
evaluation, phase and note is one plain line instead, since cursor movements would garble a log file.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from asyncrl.redaction import scrub
from asyncrl.telemetry.record import pool_point
from asyncrl.telemetry.sinks import PoolSnapshot, Sink


@dataclass
class ProgressState:
    """What the view shows, updated by each event."""

    max_steps: int = 0
    phase: str = "starting"
    phase_since: float = 0.0
    row: dict[str, Any] | None = None
    accuracy: float | None = None
    tokens_trained: int = 0
    generated_per_s: float | None = None
    steps_before: int | None = None
    """The steps a resumed run had done before this process (its first row's step - 1)."""

    def trained_per_s(self) -> float | None:
        wall = self.row["wall_s"] if self.row else 0.0
        return self.tokens_trained / wall if wall > 0 else None

    def eta_s(self) -> float | None:
        """Steps left times the mean step time of this process so far (the run's pace is steady once engines are
        warm; a resumed run's earlier steps took none of this process's time)."""
        if not self.row or not self.max_steps:
            return None
        done = self.row["step"] - (self.steps_before or 0)
        if done <= 0:
            return None
        return max(0, self.max_steps - self.row["step"]) * self.row["wall_s"] / done


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def _rate(per_s: float | None) -> str:
    return "-" if per_s is None else f"{per_s / 1000:.1f}k" if per_s >= 1000 else f"{per_s:.0f}"


def step_text(state: ProgressState) -> str:
    """One line of figures for the last step (the plain line, and the live view's second line)."""
    row = state.row or {}
    acc = f"{state.accuracy:.3f}" if state.accuracy is not None else "  -  "
    k3 = row.get("mismatch_k3_kl", float("nan"))
    return (
        f"step {row['step']:4d}/{state.max_steps}  v{row['version']:<4d} reward {row['reward']:.3f}  heldout {acc}  "
        f"staleness {row['staleness_mean']:.2f} (max {row['staleness_max']})  mismatch k3 {k3:.1e}  "
        f"loss {row['loss']:+.4f}  tok/s {_rate(state.trained_per_s())} trained "
        f"{_rate(state.generated_per_s)} generated  ETA {_duration(state.eta_s())}"
    )


class Progress(Sink):
    def __init__(
        self,
        enabled: bool = True,
        stream=sys.stdout,
        every_steps: int = 1,
        max_steps: int = 0,
        live: bool | None = None,
    ):
        """`live`: the redrawing view (default: when `stream` is a terminal)."""
        self.every_steps = every_steps
        self.enabled = enabled
        self.stream = stream
        self.started = time.perf_counter()
        self.state = ProgressState(max_steps=max_steps, phase_since=self.started)
        use_live = enabled and (live if live is not None else _is_tty(stream))
        self.view = _LiveView(stream, self) if use_live else None

    def _print(self, text: str) -> None:
        if not self.enabled:
            return
        line = scrub(f"[{time.perf_counter() - self.started:7.1f}s] {text}")  # the job's log: no secret values
        if self.view is not None:
            self.view.print(line)
        else:
            print(line, file=self.stream, flush=True)

    def step(self, row: dict) -> None:
        self.state.row = row
        if self.state.steps_before is None:
            self.state.steps_before = row["step"] - 1
        self.state.tokens_trained += row.get("tokens", 0)
        if self.view is None and row["step"] % self.every_steps == 0:
            self._print(step_text(self.state))

    def pool(self, snapshot: PoolSnapshot) -> None:
        self.state.generated_per_s = pool_point(snapshot)["rollout_tokens_per_s"]

    def note(self, text: str) -> None:
        self._print(text)

    def phase(self, text: str) -> None:
        self.state.phase, self.state.phase_since = text, time.perf_counter()
        self._print(text)

    def eval(self, record: dict) -> None:
        self.state.accuracy = record["accuracy"]
        self._print(
            f"eval  v{record['version']:<4d} held-out accuracy {record['accuracy']:.3f} "
            f"after {record['samples_trained']} samples"
        )

    def close(self, summary: dict) -> None:
        if self.view is not None:
            self.view.stop()


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _LiveView:
    """rich `Live` on the stream: redraws `render()` four times a second from its own thread."""

    def __init__(self, stream, progress: Progress):
        from rich.console import Console
        from rich.live import Live

        self.progress = progress
        self.console = Console(file=stream, force_terminal=True)
        self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def render(self):
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table

        state = self.progress.state
        grid = Table.grid(padding=(0, 1))
        if state.row is None:
            since = time.perf_counter() - state.phase_since
            grid.add_row(Spinner("dots"), f"{state.phase}  ({since:.0f}s)")
            return grid
        grid.add_row(
            ProgressBar(total=max(1, state.max_steps), completed=state.row["step"], width=30), step_text(state)
        )
        return grid

    def print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)

    def stop(self) -> None:
        self.live.refresh()
        self.live.stop()
