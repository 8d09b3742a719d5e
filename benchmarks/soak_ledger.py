"""What a soak's trajectory logs say, by sample id, about samples trained twice or lost across resumed legs.

Each leg of a soak is one `asyncrl run` process; it writes its own Parquet log (renamed `trajectories.leg-N.parquet`
by the soak), one row per sample that reached a terminal state, `trained` rows in the order they were trained.
A leg resumes from a checkpoint that had trained S samples in all (`extra.json`'s `samples_trained`), so of leg
i's trained rows the first `S_end(i) - S_start(i)` are *kept* (in the weights the next leg starts from) and the
rest are *rolled back*: a crash after the checkpoint undoes them, and the next legs must bring those samples to a
terminal state again (usually trained; a regenerated group may be filtered instead).

- trained twice: a (group_id, sample_index) trained twice in one leg, or kept by two legs. Must be 0.
- lost: a rolled-back sample that no later leg's log shows again. Must be 0. Only checkable while the later
  legs' logs are readable: a leg whose driver was SIGKILLed leaves its Parquet log without a footer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SampleId = tuple[str, int]


@dataclass(frozen=True)
class LegLog:
    """One leg's log: its rows' ids and fates in file order (None: unreadable), and the cumulative trained
    samples of the checkpoint it resumed from (`start`) and of the one the next leg resumed from (`end`)."""

    rows: list[tuple[SampleId, str]] | None
    start: int
    end: int

    @property
    def trained(self) -> list[SampleId]:
        return [sid for sid, fate in self.rows or [] if fate == "trained"]

    @property
    def kept(self) -> list[SampleId]:
        return self.trained[: self.end - self.start]

    @property
    def rolled_back(self) -> list[SampleId]:
        return self.trained[self.end - self.start :]


@dataclass
class LedgerReport:
    trained_twice: int = 0
    """Distinct samples trained twice within one leg or kept by two legs."""
    lost: int = 0
    """Rolled-back samples that no later readable leg brought to a terminal state again."""
    kept_verified: int = 0
    """Kept samples read from the logs (those of unreadable logs are counted in `kept_unverifiable`)."""
    kept_unverifiable: int = 0
    rolled_back: int = 0
    rolled_back_unverifiable: int = 0
    """Rolled-back samples with an unreadable log after them (their retraining cannot be checked)."""
    unreadable_logs: list[int] = field(default_factory=list)


def read_leg(path: Path, start: int, end: int) -> LegLog:
    """A leg's log, or one with `rows=None` when the file is absent or was cut by a crash (no footer)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["group_id", "sample_index", "fate"]).to_pydict()
    except (OSError, ValueError):  # pyarrow: ArrowInvalid (a ValueError) for a file without its footer
        return LegLog(None, start, end)
    ids = zip(table["group_id"], table["sample_index"])
    return LegLog([((g, int(i)), fate) for (g, i), fate in zip(ids, table["fate"])], start, end)


def analyse(legs: list[LegLog]) -> LedgerReport:
    """The report over the legs, in the order they ran."""
    report = LedgerReport(unreadable_logs=[i for i, leg in enumerate(legs) if leg.rows is None])
    kept_by_all: Counter[SampleId] = Counter()
    twice: set[SampleId] = set()
    for i, leg in enumerate(legs):
        if leg.rows is None:
            report.kept_unverifiable += leg.end - leg.start
            continue
        twice |= {sid for sid, n in Counter(leg.trained).items() if n > 1}
        kept_by_all.update(set(leg.kept))
        report.kept_verified += len(leg.kept)
        _check_rolled_back(leg, legs[i + 1 :], report)
    twice |= {sid for sid, n in kept_by_all.items() if n > 1}
    report.trained_twice = len(twice)
    return report


def _check_rolled_back(leg: LegLog, later: list[LegLog], report: LedgerReport) -> None:
    """Count `leg`'s rolled-back samples, and those of them no later log shows (lost, when all are readable)."""
    pending = set(leg.rolled_back)
    report.rolled_back += len(pending)
    if any(other.rows is None for other in later):
        report.rolled_back_unverifiable += len(pending)
        return
    seen = {sid for other in later for sid, _ in other.rows or []}
    report.lost += len(pending - seen)
