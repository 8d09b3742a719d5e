"""Smoke check of the benchmark scripts (`--quick`): each runs, prints its table and writes JSON whose
figures are finite; `CHECKS` adds, per script, figures that can be recomputed from the same JSON (ratios against
their parts) or that must hold (parity, every call answered). `make test` runs the scripts whose machinery no other
test runs (`QUICK`); `make bench-quick` runs this whole module (`BENCH_QUICK` too). The W1 script's machinery is
covered by test_modes.py; W2's runs streaming alone (each mode is a whole run, ~50 s here: the modes themselves are
covered by test_modes.py, the sync-relative figures by tests/unit/test_benchmark_helpers.py). `limits.py` is left
to `make bench-quick`'s script loop: its three engines and four learners took 190 s of a loaded suite, and its
model's arithmetic (the limits, the wait replay, W2's fractions) has unit tests in tests/unit/test_benchmark_helpers.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


EXTRA_ARGS = {"async_speedup": ["--modes", "streaming"], "weight_sync_gpu": ["--device", "cpu"]}
RESULT_NAMES = {"weight_sync_gpu": "weight_sync_gpu_cpu"}  # a CPU run of the GPU wire benchmark never overwrites a GPU result


def _run(name: str) -> dict:
    command = [sys.executable, str(BENCH / f"{name}.py"), "--quick", *EXTRA_ARGS.get(name, [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), f"{name} printed no table"
    return json.loads((BENCH / "results" / f"{RESULT_NAMES.get(name, name)}_quick.json").read_text())


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


QUICK = ["algo_throughput", "queue_throughput", "peer_trl", "weight_sync_gpu"]
BENCH_QUICK = ["weight_sync", "async_speedup", "logprob_layout", "client_floor", "agent_tool"]
"""Left to `make bench-quick` (marker `bench_quick`, deselected by `make test`): ~280 s of a loaded suite for
machinery the suite proves elsewhere (the weight syncs' parity: tests/integration/test_weight_sync_*.py; streaming:
test_modes.py; the start-up heap freeze: test_rollout_engine.py; the tools: tests/integration/test_tool_pool.py)."""


@pytest.mark.parametrize("name", QUICK + [pytest.param(n, marks=pytest.mark.bench_quick) for n in BENCH_QUICK])
def test_benchmark_quick_run_writes_finite_results(name):
    result = _run(name)
    values = list(_numbers(result))
    assert values and all(math.isfinite(v) for v in values)
    CHECKS.get(name, lambda r: None)(result)


def _weight_sync_gpu(result):  # the CPU wire: both transports, every size, every byte arrived
    assert {(r["transport"], r["size"]) for r in result["rows"]} == {(t, s) for t in ("gloo", "ipc") for s in ("w3-0.5m", "w3-25m")}
    assert all("error" not in r and r["parity"] == 0.0 and r["total_s"] >= r["stage_s"] for r in result["rows"])


def _weight_sync(result):
    assert all(r["parity_after_max"] < 1e-4 < r["parity_before_max"] for r in result["sizes"])


def _peer_trl(result):  # same warm start as asyncrl's runs; 4 steps x 256 samples
    assert 0.15 < result["start_accuracy"] < 0.6 and result["samples_trained"] == 4 * 256


def _logprob_layout(result):
    assert [r["tokens"] for r in result["runs"]] == [128, 6]
    assert all(r["dict_over_flat"] == pytest.approx(r["dict_us_per_request"] / r["flat_us_per_request"], rel=0.01)
               for r in result["runs"])


def _client_floor(result):
    """`Engine` freezes the start-up heap; the ratio is the two clients' mean CPU per sample."""
    assert result["freeze"] and result["frozen_objects"] > 10_000
    mean = result["mean_us_per_sample"]
    assert result["engine_over_vllm"] == pytest.approx(mean["engine"] / mean["vllm"], rel=0.01)


def _agent_tool(result):
    """Every warm call of each tool answered; the reward pool's warm process beats a fresh one per call."""
    one_worker = result["runs"][0]
    assert one_worker["workers"] == 1
    assert [one_worker[tool]["n"] for tool in ("calculator", "python")] == [result["config"]["warm_calls"]] * 2
    assert result["reward_default_over_fresh_process"] > 1


CHECKS = {"weight_sync": _weight_sync, "peer_trl": _peer_trl, "logprob_layout": _logprob_layout,
          "client_floor": _client_floor, "agent_tool": _agent_tool,
          "weight_sync_gpu": _weight_sync_gpu}
