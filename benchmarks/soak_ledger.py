"""What a soak's trajectory logs say, by sample id, about samples trained twice or lost across resumed legs.

Each leg of a soak is one `asyncrl run` process; it writes its own Parquet log (renamed `trajectories.leg-N.parquet`
by the soak), one row per sample that reached a terminal state, `trained` rows in the order they were trained.
A sample is (prompt_id, sample_index): a prompt id is unique per draw (`add-<seed>-<i>`), while a group that
a checkpoint moved back to the backlog gets a new group id when it starts again after the resume.
A leg resumes from a checkpoint that had trained S samples in all (`extra.json`'s `samples_trained`), so of leg
i's trained rows the first `S_end(i) - S_start(i)` are *kept* (in the weights the next leg starts from) and the
rest are *rolled back*: a crash after the checkpoint undoes them, and the next legs must bring those samples to a
terminal state again (usually trained; a regenerated group may be filtered instead).

- trained twice: a (group_id, sample_index) trained twice in one leg, or kept by two legs. Must be 0.
- lost: a rolled-back sample that no later leg's log shows again and whose prompt is not pending in the last
  checkpoint's backlog (the next resume would run it). Must be 0. Only checkable while the later legs' logs are
  readable: a leg whose driver was SIGKILLed may leave its Parquet log without a footer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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
    def complete(self) -> bool:
        """Readable, and holding every sample the leg kept: a SIGKILLed queue loses the rows it had not
        flushed yet, while the checkpoint counts them."""
        return self.rows is not None and len(self.trained) >= self.end - self.start

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
    """Rolled-back samples that no later readable leg brought to a terminal state again, nor pending."""
    kept_verified: int = 0
    """Kept samples read from the logs (those of unreadable logs are counted in `kept_unverifiable`)."""
    kept_unverifiable: int = 0
    rolled_back: int = 0
    rolled_back_pending: int = 0
    """Rolled-back samples not run again yet: the last checkpoint's resume would run their prompt."""
    rolled_back_unverifiable: int = 0
    """Rolled-back samples with an unreadable log after them (their retraining cannot be checked)."""
    unreadable_logs: list[int] = field(default_factory=list)
    """Legs whose log is unreadable or lacks rows of samples the leg kept."""


def read_leg(path: Path, start: int, end: int) -> LegLog:
    """A leg's log, or one with `rows=None` when the file is absent or was cut by a crash (no footer)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["prompt_id", "sample_index", "fate"]).to_pydict()
    except (OSError, ValueError):  # pyarrow: ArrowInvalid (a ValueError) for a file without its footer
        return LegLog(None, start, end)
    ids = zip(table["prompt_id"], table["sample_index"])
    return LegLog([((g, int(i)), fate) for (g, i), fate in zip(ids, table["fate"])], start, end)


def analyse(legs: list[LegLog], pending: Callable[[str], bool] = lambda prompt_id: False) -> LedgerReport:
    """The report over the legs, in the order they ran; `pending(prompt_id)`: whether a resume from the
    checkpoint the last leg left would run that prompt (it waits in the backlog, or is not drawn yet)."""
    report = LedgerReport(unreadable_logs=[i for i, leg in enumerate(legs) if not leg.complete])
    kept_by_all: Counter[SampleId] = Counter()
    twice: set[SampleId] = set()
    for i, leg in enumerate(legs):
        if not leg.complete:
            report.kept_unverifiable += leg.end - leg.start
            continue
        twice |= {sid for sid, n in Counter(leg.trained).items() if n > 1}
        kept_by_all.update(set(leg.kept))
        report.kept_verified += len(leg.kept)
        _check_rolled_back(leg, legs[i + 1 :], pending, report)
    twice |= {sid for sid, n in kept_by_all.items() if n > 1}
    report.trained_twice = len(twice)
    return report


def _check_rolled_back(leg: LegLog, later: list[LegLog], pending: Callable[[str], bool], report: LedgerReport) -> None:
    """Count `leg`'s rolled-back samples, and those of them no later log shows nor the backlog holds (lost,
    when all later logs are readable)."""
    undone = set(leg.rolled_back)
    report.rolled_back += len(undone)
    if not all(other.complete for other in later):
        report.rolled_back_unverifiable += len(undone)
        return
    unseen = undone - {sid for other in later for sid, _ in other.rows or []}
    waiting = {sid for sid in unseen if pending(sid[0])}
    report.rolled_back_pending += len(waiting)
    report.lost += len(unseen - waiting)
