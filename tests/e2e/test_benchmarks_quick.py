"""Smoke check of the benchmark scripts (`--quick`): each runs, prints its table and writes JSON whose
headline figures are finite and positive. The W1 script's machinery is covered by test_modes.py; W2's runs
streaming alone (each mode is a whole run, ~50 s here: the modes themselves are covered by test_modes.py, the
sync-relative figures by tests/unit/test_benchmark_helpers.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


EXTRA_ARGS = {"async_speedup": ["--modes", "streaming"]}


def _run(name: str) -> dict:
    command = [sys.executable, str(BENCH / f"{name}.py"), "--quick", *EXTRA_ARGS.get(name, [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), f"{name} printed no table"
    return json.loads((BENCH / "results" / f"{name}_quick.json").read_text())


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


@pytest.mark.parametrize("name", ["algo_throughput", "queue_throughput", "weight_sync", "async_speedup", "peer_trl"])
def test_benchmark_quick_run_writes_finite_results(name):
    result = _run(name)
    values = list(_numbers(result))
    assert values and all(math.isfinite(v) for v in values)
    if name == "weight_sync":
        assert all(r["parity_after_max"] < 1e-4 < r["parity_before_max"] for r in result["sizes"])
    if name == "peer_trl":  # same warm start as asyncrl's runs; 4 steps x 256 samples
        assert 0.15 < result["start_accuracy"] < 0.6 and result["samples_trained"] == 4 * 256
