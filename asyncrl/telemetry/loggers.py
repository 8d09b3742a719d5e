"""Optional experiment loggers (`telemetry.tensorboard`, `telemetry.wandb`): telemetry sinks that receive the
same scalars as the dashboard. Each imports its library only when configured (extras `tensorboard`, `wandb`).

Scalar names: `train/<key>` for every number of a step row (and `train/lag=<n>` for its staleness counts),
`eval/accuracy`, `sync/seconds` (and `sync/parity` when probed), `pool/<figure>` from the pool snapshots
(`record.pool_point`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from asyncrl.telemetry.record import pool_point
from asyncrl.telemetry.sinks import PoolSnapshot, Sink, SyncEvent


def step_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a step row as `train/*` scalars; `lag_counts` becomes one scalar per lag."""
    scalars = {f"train/{k}": float(v) for k, v in row.items() if _is_number(v)}
    scalars.update({f"train/lag={lag}": float(n) for lag, n in row.get("lag_counts", {}).items()})
    return scalars


def pool_scalars(snapshot: PoolSnapshot) -> dict[str, float]:
    return {f"pool/{k}": float(v) for k, v in pool_point(snapshot).items() if _is_number(v)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TensorBoardSink(Sink):
    """Event files under `log_dir`; pool figures are logged at the last step seen (TensorBoard's x is a step)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.last_step = 0

    def _write(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def step(self, row: dict[str, Any]) -> None:
        self.last_step = row["step"]
        self._write(step_scalars(row), row["step"])

    def eval(self, record: dict[str, Any]) -> None:
        self._write({"eval/accuracy": record["accuracy"]}, record["step"])

    def sync(self, event: SyncEvent) -> None:
        parity = {} if event.parity is None else {"sync/parity": event.parity}
        self._write({"sync/seconds": event.seconds, **parity}, event.version)

    def pool(self, snapshot: PoolSnapshot) -> None:
        self._write(pool_scalars(snapshot), self.last_step)

    def close(self, summary: dict[str, Any]) -> None:
        self.writer.close()


class WandbSink(Sink):
    """One W&B run per training run. Rows can arrive after a later evaluation (a row waits for its weight sync),
    and W&B drops a logged step lower than the last, so each family is logged against its own x key
    (`define_metric`) instead of W&B's step."""

    X_KEYS = {"train": "train/step", "eval": "eval/step", "sync": "sync/version", "pool": "pool/wall_s"}

    def __init__(self, project: str, mode: Literal["offline", "online"], out: Path, name: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, mode=mode, dir=str(out), name=name, config=config, reinit="create_new")
        for family, x in self.X_KEYS.items():
            self.run.define_metric(x)
            self.run.define_metric(f"{family}/*", step_metric=x)

    def step(self, row: dict[str, Any]) -> None:
        self.run.log(step_scalars(row))

    def eval(self, record: dict[str, Any]) -> None:
        self.run.log(
            {"eval/step": record["step"], "eval/version": record["version"], "eval/accuracy": record["accuracy"]}
        )

    def sync(self, event: SyncEvent) -> None:
        parity = {} if event.parity is None else {"sync/parity": event.parity}
        self.run.log({"sync/version": event.version, "sync/seconds": event.seconds, **parity})

    def pool(self, snapshot: PoolSnapshot) -> None:
        self.run.log(pool_scalars(snapshot))

    def close(self, summary: dict[str, Any]) -> None:
        self.run.finish(exit_code=1 if summary.get("error") else 0)
