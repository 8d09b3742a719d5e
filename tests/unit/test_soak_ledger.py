"""The soak's by-id accounting across resumed legs, on hand-made Parquet logs (benchmarks/soak_ledger.py)."""

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from soak_ledger import analyse, read_leg  # noqa: E402


def _log(path: Path, rows: list[tuple[str, int, str]]) -> Path:
    prompts, indices, fates = zip(*rows)
    pq.write_table(pa.table({"prompt_id": list(prompts), "sample_index": list(indices), "fate": list(fates)}), path)
    return path


def _cut(path: Path) -> Path:
    """A log whose writer was SIGKILLed: the data pages are there, the footer is not."""
    whole = _log(path, [("p0", 0, "trained")]).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


# Leg 0 resumed from nothing (0 trained) and the next leg from its checkpoint at 2 trained samples: a0, a1 kept;
# b0 (trained after the checkpoint) rolled back; the crash-free leg 1 (from 2 to 5) trains b0 again and keeps it.
LEG0 = [("add-0-0", 0, "trained"), ("add-0-0", 1, "trained"), ("add-0-9", 0, "filtered:zero_variance"), ("add-0-1", 0, "trained")]
LEG1 = [("add-0-1", 0, "trained"), ("add-0-1", 1, "trained"), ("add-0-2", 0, "trained")]


def test_a_rolled_back_sample_trained_again_by_the_next_leg_is_neither_twice_nor_lost(tmp_path):
    legs = [read_leg(_log(tmp_path / "0.parquet", LEG0), 0, 2), read_leg(_log(tmp_path / "1.parquet", LEG1), 2, 5)]
    report = analyse(legs)
    assert (report.trained_twice, report.lost, report.rolled_back) == (0, 0, 1)
    assert report.kept_verified == 2 + 3 and report.unreadable_logs == []


def test_a_sample_kept_by_two_legs_counts_as_trained_twice(tmp_path):
    # Leg 0 kept all 3 of its trained rows (end 3), so leg 1 training add-0-1/0 again is a duplicate.
    legs = [read_leg(_log(tmp_path / "0.parquet", LEG0), 0, 3), read_leg(_log(tmp_path / "1.parquet", LEG1), 3, 6)]
    assert analyse(legs).trained_twice == 1


def test_a_duplicate_within_one_leg_counts_even_after_the_checkpoint(tmp_path):
    rows = [("add-0-0", 0, "trained"), ("add-0-0", 0, "trained")]
    assert analyse([read_leg(_log(tmp_path / "0.parquet", rows), 0, 0)]).trained_twice == 1


def test_a_rolled_back_sample_no_later_leg_shows_is_lost_unless_its_prompt_waits_in_the_backlog(tmp_path):
    later = [("add-0-2", 0, "trained")]
    legs = [read_leg(_log(tmp_path / "0.parquet", LEG0), 0, 2), read_leg(_log(tmp_path / "1.parquet", later), 2, 3)]
    report = analyse(legs)
    assert (report.lost, report.trained_twice) == (1, 0)
    report = analyse(legs, pending=lambda prompt_id: prompt_id == "add-0-1")
    assert (report.lost, report.rolled_back_pending) == (0, 1)


def test_a_log_cut_by_a_crash_is_unreadable_and_its_kept_samples_unverifiable(tmp_path):
    legs = [read_leg(_log(tmp_path / "0.parquet", LEG0), 0, 2), read_leg(_cut(tmp_path / "1.parquet"), 2, 7)]
    report = analyse(legs)
    assert report.unreadable_logs == [1] and report.kept_unverifiable == 5
    assert (report.lost, report.rolled_back_unverifiable) == (0, 1)  # add-0-1/0 may be in the cut log: not lost


def test_a_leg_that_never_opened_its_log_reads_as_unreadable(tmp_path):
    assert read_leg(tmp_path / "absent.parquet", 0, 0).rows is None


def test_a_readable_log_short_of_the_samples_its_leg_kept_counts_as_cut(tmp_path):
    # The leg's checkpoint counts 4 kept samples, its log holds 3 (a SIGKILLed queue had not flushed the 4th).
    legs = [read_leg(_log(tmp_path / "0.parquet", LEG0), 0, 2), read_leg(_log(tmp_path / "1.parquet", LEG1), 2, 6)]
    report = analyse(legs)
    assert report.unreadable_logs == [1] and report.kept_unverifiable == 4
