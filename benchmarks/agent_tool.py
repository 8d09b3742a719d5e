"""Agent tools: tool-call latency through the sandboxed tool-worker pool (the tool section of `agent_tool`).

A driver-side `ToolClient` calls real tool workers (Ray actors) the way a rollout worker does. Reported:
- warm latency p50/p99 of `calculator` and `python` calls (each call starts after the worker's pre-started
  sandbox is ready, as between two turns of an episode: the model's generation hides the start);
- sandbox start p50/p99 (process start until its interpreter waits for a program, as the workers measured it);
- back-to-back `python` calls/s with N workers (`--workers`, 4 calls in flight per worker): start-up bound;
- user reward calls/s (`math_reward:equal`, which imports sympy) with 64 calls in flight on 2 workers, as
  when many trajectories finish together, and each call's latency p50/p99: a fresh process per call
  (`tools.reward_process_calls=1`), a kept process per reward with one call per message (`reward_batch=1`),
  and the default (kept processes, up to 32 waiting calls per message).
The machine's load average is recorded: a shared machine's figures say so.

    python benchmarks/agent_tool.py            # 200 warm calls per tool, 1 and 2 workers for 20 s each
    python benchmarks/agent_tool.py --quick    # smoke size, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

REWARD = "math_reward:equal"
REWARD_SETTINGS = ((1, 1), (1024, 1), (1024, 32))
"""(tools.reward_process_calls, tools.reward_batch) of each reward run; the first is the baseline."""
REWARD_IN_FLIGHT = 64

PROGRAM = "print(sum(i * i for i in range(100)))"
WARM_GAP_S = 0.4
"""Pause between warm calls: longer than a sandbox start, so each call finds its pre-started process ready."""


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values) * 1000.0
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2), "n": len(values)}


async def warm_latency(client, tool: str, arguments: str, calls: int) -> list[float]:
    from asyncrl.envs.tools.base import ToolCall

    seconds = []
    for _ in range(calls):
        await asyncio.sleep(WARM_GAP_S)
        began = time.perf_counter()
        result = await client.call(ToolCall(tool, arguments), 10.0)
        seconds.append(time.perf_counter() - began)
        assert result.ok, result
    return seconds


async def throughput(client, duration_s: float, in_flight: int) -> float:
    """Back-to-back `python` calls with `in_flight` outstanding for `duration_s`; calls per second."""
    from asyncrl.envs.tools.base import ToolCall

    done = 0
    deadline = time.perf_counter() + duration_s

    async def loop():
        nonlocal done
        while time.perf_counter() < deadline:
            result = await client.call(ToolCall("python", PROGRAM), 10.0)
            done += result.ok

    began = time.perf_counter()
    await asyncio.gather(*[loop() for _ in range(in_flight)])
    return done / (time.perf_counter() - began)


async def reward_load(client, duration_s: float, in_flight: int) -> tuple[float, list[float]]:
    """`in_flight` callers each scoring back to back for `duration_s` (answers alternate right and wrong, and
    each value is checked); -> (calls per second, each call's seconds)."""
    seconds: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def caller(k: int):
        while time.perf_counter() < deadline:
            response = "24/2" if (k + len(seconds)) % 2 == 0 else "13"
            began = time.perf_counter()
            value = await client.reward(REWARD, response, "12", finish_reason="stop", extra_info={}, timeout_s=60.0)
            assert value == (1.0 if response == "24/2" else 0.0), (response, value)
            seconds.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*[caller(k) for k in range(in_flight)])
    return len(seconds) / (time.perf_counter() - began), seconds


def measure_rewards(ray, process_calls: int, batch: int, args) -> dict:
    from asyncrl.config import ToolsConfig
    from asyncrl.envs.tools.pool import ToolPool

    tools = ToolsConfig(num_workers=2, num_cpus_per_worker=0.5, calls_per_worker=4, reward_process_calls=process_calls, reward_batch=batch)
    pool = ToolPool(tools, prefix=f"bench-reward-{process_calls}-{batch}")
    pool.start()
    try:
        rate, seconds = asyncio.run(reward_load(pool.client(), args.duration_s, REWARD_IN_FLIGHT))
        return {"reward_process_calls": process_calls, "reward_batch": batch, "calls_per_s": round(rate, 2), **percentiles(seconds)}
    finally:
        pool.shutdown()


def measure(ray, workers: int, args) -> dict:
    from asyncrl.config import ToolsConfig
    from asyncrl.envs.tools.pool import ToolPool

    pool = ToolPool(ToolsConfig(num_workers=workers, num_cpus_per_worker=0.5, calls_per_worker=4), prefix=f"bench-tool-{workers}")
    pool.start()
    try:
        client = pool.client()
        row: dict = {"workers": workers}
        if workers == 1:
            row["calculator"] = percentiles(asyncio.run(warm_latency(client, "calculator", "123 * 456 + 7", args.calls)))
            row["python"] = percentiles(asyncio.run(warm_latency(client, "python", PROGRAM, args.calls)))
        row["python_calls_per_s"] = round(asyncio.run(throughput(client, args.duration_s, 4 * workers)), 2)
        starts = [s for name in pool.names for s in ray.get(ray.get_actor(name).start_seconds.remote())]
        row["sandbox_start"] = percentiles(starts)
        row["sandbox"] = pool.capabilities.method
        return row
    finally:
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "agent_tool", "smoke size (~1 min)")
    parser.add_argument("--calls", type=int, default=None, help="warm calls per tool (default 200, quick 30)")
    parser.add_argument("--duration-s", type=float, default=None, help="seconds of the calls/s run (default 20, quick 5)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tool-worker counts of the calls/s runs")
    args = parser.parse_args()
    args.calls = args.calls or (30 if args.quick else 200)
    args.duration_s = args.duration_s or (5.0 if args.quick else 20.0)

    common.set_runtime_env()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)  # math_reward
    import ray

    load_start = common.load_average()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = [measure(ray, n, args) for n in sorted(set([1, *args.workers]))]
        rewards = [measure_rewards(ray, calls, batch, args) for calls, batch in REWARD_SETTINGS]
    finally:
        ray.shutdown()

    warm = rows[0]
    print(f"agent tools: latency through the sandboxed tool-worker pool ({warm['sandbox']} sandbox, {args.calls} warm calls per tool)")
    print(f"{'':>24}{'p50_ms':>10}{'p99_ms':>10}")
    for label, stats in (("calculator (warm)", warm["calculator"]), ("python (warm)", warm["python"]), ("sandbox start", warm["sandbox_start"])):
        print(f"{label:>24}{stats['p50_ms']:>10}{stats['p99_ms']:>10}")
    print(f"{'workers':>24}{'python calls/s':>16}")
    for row in rows:
        print(f"{row['workers']:>24}{row['python_calls_per_s']:>16}")

    print(f"user reward {REWARD}, {REWARD_IN_FLIGHT} calls in flight on 2 workers")
    print(f"{'process calls':>16}{'batch':>8}{'calls/s':>10}{'p50_ms':>10}{'p99_ms':>10}{'x fresh':>9}")
    for row in rewards:
        row["speedup"] = round(row["calls_per_s"] / max(rewards[0]["calls_per_s"], 1e-9), 2)
        print(f"{row['reward_process_calls']:>16}{row['reward_batch']:>8}{row['calls_per_s']:>10}{row['p50_ms']:>10}{row['p99_ms']:>10}{row['speedup']:>9}")

    result = {
        "workload": "agent tools",
        "quick": args.quick,
        "sandbox": warm["sandbox"],
        "calculator_p50_ms": warm["calculator"]["p50_ms"], "calculator_p99_ms": warm["calculator"]["p99_ms"],
        "python_p50_ms": warm["python"]["p50_ms"], "python_p99_ms": warm["python"]["p99_ms"],
        "sandbox_start_p99_ms": warm["sandbox_start"]["p99_ms"],
        "python_calls_per_s_by_workers": {str(r["workers"]): r["python_calls_per_s"] for r in rows},
        "reward": REWARD, "reward_default_over_fresh_process": rewards[-1]["speedup"], "reward_runs": rewards,
        "config": {"warm_calls": args.calls, "warm_gap_s": WARM_GAP_S, "duration_s": args.duration_s, "calls_in_flight_per_worker": 4,
                   "reward_calls_in_flight": REWARD_IN_FLIGHT},
        "machine": common.machine(load_start),
        "runs": rows,
    }  # fmt: skip
    out = common.output_path("agent_tool", args)
    common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
