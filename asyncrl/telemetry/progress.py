"""The console view of a run (a telemetry `Sink`): one line per step (step, version, reward, held-out accuracy,
staleness, mismatch), per evaluation, per start-up phase and per note."""

from __future__ import annotations

import sys
import time

from asyncrl.telemetry.sinks import Sink


class Progress(Sink):
    def __init__(self, enabled: bool = True, stream=sys.stdout, every_steps: int = 1):
        self.every_steps = every_steps
        self.enabled = enabled
        self.stream = stream
        self.started = time.perf_counter()
        self.accuracy: float | None = None

    def _print(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.started:7.1f}s] {text}", file=self.stream, flush=True)

    def step(self, row: dict) -> None:
        if row["step"] % self.every_steps:
            return
        acc = f"{self.accuracy:.3f}" if self.accuracy is not None else "  -  "
        k3 = row.get("mismatch_k3_kl", float("nan"))
        self._print(
            f"step {row['step']:4d}  v{row['version']:<4d} reward {row['reward']:.3f}  heldout {acc}  "
            f"staleness {row['staleness_mean']:.2f} (max {row['staleness_max']})  mismatch k3 {k3:.1e}  loss {row['loss']:+.4f}"
        )

    def note(self, text: str) -> None:
        self._print(text)

    def phase(self, text: str) -> None:
        self._print(text)

    def eval(self, record: dict) -> None:
        self.accuracy = record["accuracy"]
        self._print(f"eval  v{record['version']:<4d} held-out accuracy {record['accuracy']:.3f} after {record['samples_trained']} samples")
