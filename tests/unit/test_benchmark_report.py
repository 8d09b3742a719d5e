"""benchmarks/report.py: RESULTS.md is its output, and how results and hand-written notes make a section."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))

import report  # noqa: E402


def test_results_md_is_the_report_of_the_results_and_notes():
    # Edit a note or add a result, then: python benchmarks/report.py > benchmarks/RESULTS.md
    assert (BENCHMARKS / "RESULTS.md").read_text() == report.render(), "benchmarks/RESULTS.md is stale: regenerate it with report.py"


def test_every_note_is_in_the_layout():
    notes = {p.stem for p in (BENCHMARKS / "notes").glob("*.md")}
    assert notes <= set(report.LAYOUT), f"notes no section shows: {sorted(notes - set(report.LAYOUT))}"


def _write(folder: Path, name: str, text: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)


def test_a_section_is_the_result_then_its_note_whose_title_replaces_the_generated_one(tmp_path):
    results, notes = tmp_path / "results", tmp_path / "notes"
    _write(results, "queue_like.json", json.dumps({"groups": 64, "machine": {"cpus": 2, "platform": "P"}}))
    _write(results, "stray.json", json.dumps({"x": 1}))
    _write(results, "stray_quick.json", json.dumps({"x": 1}))
    _write(notes, "queue_like.md", "## Queue, 2026-12-04\n\nRan twice; this is the second.\n")
    _write(notes, "prose.md", "## A hand-written section\n\nOnly words.\n")
    text = report.render(results, notes, ["queue_like", "prose"])
    assert text == (
        "# asyncrl benchmark results\n\n"
        "## Queue, 2026-12-04\n\n| key | value |\n|---|---|\n| groups | 64 |\n\n_Machine: 2 CPUs, P; source `queue_like.json`._\n\n"
        "Ran twice; this is the second.\n\n"
        "## A hand-written section\n\nOnly words.\n\n"
        "## Other result files\n\nRuns no section above reads (raw JSON in `benchmarks/results/`): `stray.json`.\n"
    )


def test_a_layout_entry_with_neither_result_nor_titled_note_is_named(tmp_path):
    _write(tmp_path / "notes", "untitled.md", "words without a title\n")
    with pytest.raises(ValueError, match=r"LAYOUT names 'untitled'.*untitled\.md"):
        report.render(tmp_path / "results", tmp_path / "notes", ["untitled"])


def test_another_results_folder_renders_every_file_without_notes(tmp_path):
    _write(tmp_path, "a.json", json.dumps({"x": 1}))
    assert report.render(tmp_path, None, None) == "# asyncrl benchmark results\n\n## a\n\n| key | value |\n|---|---|\n| x | 1 |\n\n_Source `a.json`._\n"


def test_time_to_target_is_factored_into_steps_and_seconds_per_step():
    def evals(step_reaching: int) -> list[dict]:
        return [{"step": s, "accuracy": 0.6 if s >= step_reaching else 0.3} for s in range(0, 101, 10)]

    modes = {"streaming": {"evals": evals(40)}, "trl": {"evals": evals(80), "time_to_target_s": 20.0}}
    # streaming: 40 steps in 30 s = 0.75 s per step; the peer: 80 steps in 20 s = 0.25 s per step.
    (line,) = [x for x in report._steps_times_step_time(modes, 0.5, {"streaming": 30.0}) if x]
    assert line.endswith("against the peer's 80 steps: streaming 0.50x the steps × 3.00x the seconds per step.")
    assert "evaluated every 10 steps" in line
    assert report._steps_times_step_time(modes, 0.5, {"streaming": None}) == []
