"""What the benchmark scripts share: the `--quick`/`--out` options, the Ray/vLLM environment, machine labels
and the result JSON. A script imports it as `common` (a script's own folder is on `sys.path`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RUNTIME_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""The Makefile's environment for Ray and vLLM on CPU; a variable the caller already set wins."""


def add_output_options(parser: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """`--quick` (smoke size) and `--out`; a quick run writes `<name>_quick.json`, so a smoke run never
    overwrites the real numbers."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help=f"result JSON (default benchmarks/results/{name}[_quick].json)")


def output_path(name: str, args: argparse.Namespace) -> Path:
    """`--out`, else `results/<name>.json` (`<name>_quick.json` with `--quick`)."""
    return args.out or RESULTS / (f"{name}_quick.json" if args.quick else f"{name}.json")


def set_runtime_env() -> None:
    """Must run before Ray, vLLM or Hugging Face are imported: they read these variables at import."""
    for key, value in RUNTIME_ENV.items():
        os.environ.setdefault(key, value)


def load_average() -> float:
    """The 1-minute load average: a result taken on a busy shared machine says so."""
    return os.getloadavg()[0]


def machine(load_start: float) -> dict[str, Any]:
    """The `machine` label of a result: CPUs, Python, platform, and the load average at start and now."""
    return {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
        "load_average_1min_start": load_start, "load_average_1min_end": load_average(),
    }  # fmt: skip


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
