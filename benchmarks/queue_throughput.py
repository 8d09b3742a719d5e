"""W4 `queue`: replay-queue throughput with the staleness check on.

4 producer Ray actors take requests from the replay-queue actor and hand back small trajectories (as
`PackedTrajectories`, the column-wise wire form the rollout workers send) in the same call (`put_and_acquire`); 1
consumer actor drains it with `set_version_and_get_batch` and advances the policy version after every batch (it
does no training, so this measures the queue). Each new version is pushed to the producers (the weight sync) before
the queue is told, so the staleness check and admission control run as in a real run. Reported: trajectories/s through
the queue, put-to-get latency p50/p99 (measured by the queue), and batched puts (64 per call) against
unbatched ones (1 per call; a smaller count keeps the time bounded). The consumer's step is 64 groups of 4 (256
trajectories, the step of W1's default recipe); a second batched run takes steps of 16 groups, where each
trajectory carries four times the consumer's calls and weight-sync stand-ins. On a shared machine the wall-clock rate
is what the CPUs left over allow; the queue actor's own CPU seconds per trajectory (Ray (de)serialization
included) give its capacity, trajectories per CPU-second, a figure the neighbours' load moves far less.

    python benchmarks/queue_throughput.py            # 20,000 batched + 4,000 unbatched trajectories
    python benchmarks/queue_throughput.py --quick    # smoke size, ~10-20 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import psutil

import common  # benchmarks/common.py: a script's own folder is on sys.path

PROMPT_TOKENS = RESPONSE_TOKENS = 16


class Producer:
    """A stand-in rollout worker: answers every request at once with a fixed-size trajectory."""

    def __init__(self, queue, worker: str, put_batch: int, response_tokens: int) -> None:
        import numpy as np

        self.queue, self.worker, self.put_batch = queue, worker, put_batch
        self.response_ids = np.arange(response_tokens, dtype=np.int32)
        self.version = 0
        self.stopped = False
        self.rng = np.random.default_rng(hash(worker) % 2**32)

    async def ready(self) -> bool:
        return True

    async def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    async def stop(self) -> None:
        self.stopped = True

    def answer(self, request, reward: float):
        """The trajectory for `request`, built directly (`testing.make_answer` costs more CPU than the queue
        does per trajectory, and the producers share the machine's cores with it). Every array is its own
        copy, so that serialization pays for each as it would for a real worker's."""
        import numpy as np

        from asyncrl.types import Trajectory

        n = len(self.response_ids)
        # attempt=None: the queue matches these answers by worker only, as this benchmark always has
        return Trajectory(
            prompt_id=request.prompt.prompt_id, group_id=request.group_id, sample_index=request.sample_index,
            prompt_ids=np.asarray(request.prompt.prompt_ids, dtype=np.int32), response_ids=self.response_ids.copy(),
            rollout_logprobs=np.full(n, -0.7, dtype=np.float32), loss_mask=np.ones(n, dtype=np.int8),
            versions=np.full(n, self.version, dtype=np.int32), finish_reason="length", reward=reward, worker=self.worker,
            attempt=None, dispatch_version=self.version,
        )  # fmt: skip

    async def run(self) -> int:
        """Hand in the last answers and take the next requests in one call (`put_and_acquire`), as a rollout
        worker does; the first call puts nothing."""
        from asyncrl.types import PackedTrajectories

        produced, finished = 0, []
        while True:
            exchange = await self.queue.put_and_acquire.remote(PackedTrajectories(finished), self.worker, self.put_batch, timeout_s=0.2)
            requests, finished = exchange.requests, []
            if not requests:
                if self.stopped:
                    return produced
                continue
            rewards = self.rng.random(len(requests))
            finished = [self.answer(r, float(reward)) for r, reward in zip(requests, rewards)]
            produced += len(finished)


class Consumer:
    """A stand-in learner: takes `batch_groups` groups per step and publishes version + 1 after each."""

    def __init__(self, queue, producers) -> None:
        self.queue, self.producers = queue, producers

    async def ready(self) -> bool:
        return True

    async def run(self, batch_groups: int) -> dict:
        version, trained, max_lag = 0, 0, 0
        while True:
            # The queue learns `version` once every engine serves it (invariant 7: pushed below), so that groups
            # it admits from now on carry at least this version; the same call takes the step's batch.
            batch = await self.queue.set_version_and_get_batch.remote(version, batch_groups, timeout_s=60.0, min_groups=0)
            if not batch.groups:
                stats = await self.queue.stats.remote()
                if stats["in_flight"] == 0 and stats["backlog_groups"] == 0:
                    break
                continue
            trained += batch.num_samples
            max_lag = max(max_lag, batch.staleness_max)
            version += 1
            await asyncio.gather(*[p.set_version.remote(version) for p in self.producers])  # the weight sync
        return {"trained": trained, "steps": version, "max_lag": max_lag}


def _cpu_seconds(process) -> float:
    """User + system CPU seconds of a process, its threads included (Ray's I/O threads do the (de)serializing)."""
    times = process.cpu_times()
    return times.user + times.system


ROLES = ("queue", "producers", "consumer", "driver", "ray_system")
"""Where the benchmark's CPU goes. `ray_system`: every other process under the driver (GCS, raylet, Ray's
agents and idle workers), which routes every actor call."""


class CpuMeter:
    """CPU seconds per role over a run, from every process of this benchmark's Ray cluster (the driver and its
    descendants), so that the wall-clock rate the 2 shared cores allow is a measurement: cores ÷ total CPU
    seconds per trajectory. Neighbours' processes are not under the driver and do not count."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        driver = psutil.Process()
        named = {pid: role for role, role_pids in pids.items() for pid in role_pids}
        self.processes = [(named.get(p.pid, "ray_system"), p) for p in driver.children(recursive=True)]
        self.processes.append(("driver", driver))
        self.start = [self._last_known(process, 0.0) for _, process in self.processes]

    @staticmethod
    def _last_known(process, last: float) -> float:
        """A Ray helper may end during the run: it keeps the CPU seconds last read (at worst its end goes uncounted)."""
        try:
            return _cpu_seconds(process)
        except psutil.NoSuchProcess:
            return last

    def seconds(self) -> dict[str, float]:
        """CPU seconds of each role since the meter was made."""
        out = dict.fromkeys(ROLES, 0.0)
        for (role, process), start in zip(self.processes, self.start):
            out[role] += self._last_known(process, start) - start
        return out


def _pid(actor) -> int:
    return actor.__ray_call__.remote(lambda _self: os.getpid())


def _py_spy(pid: int, path: str | None):
    """`py-spy record` of the queue actor into `path` as collapsed stacks (text: one stack and its sample count
    a line, which speedscope and flamegraph.pl read), or None without a path."""
    if path is None:
        return None
    import shutil
    import subprocess
    import sys

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--output", path, "--rate", "200", "--nonblocking", "--format", "raw"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def run_once(ray, args, num_trajectories: int, put_batch: int, batch_groups: int, tag: str, py_spy_out: str | None = None) -> dict:
    from asyncrl.buffer import start_replay_queue
    from asyncrl.config import BufferConfig
    from asyncrl.testing import make_prompt

    config = BufferConfig(max_staleness=args.max_staleness, filter_zero_variance=False, log_parquet=False, capacity_groups=1024)
    queue = start_replay_queue(config, batch_groups=batch_groups, name=f"w4-queue-{tag}")
    producers = [
        ray.remote(Producer).options(num_cpus=0, max_concurrency=4).remote(queue.handle, f"{tag}-p{k}", put_batch, RESPONSE_TOKENS)
        for k in range(args.producers)
    ]
    consumer = ray.remote(Consumer).options(num_cpus=0).remote(queue.handle, producers)
    ray.get([a.ready.remote() for a in producers + [consumer]])
    queue.counters()  # the queue actor is up too
    pids = {role: ray.get([_pid(a) for a in actors]) for role, actors in
            [("queue", [queue.handle]), ("producers", producers), ("consumer", [consumer])]}  # fmt: skip
    num_prompts = num_trajectories // args.samples_per_prompt
    prompts = [make_prompt(f"q{k}", range(PROMPT_TOKENS)) for k in range(num_prompts)]
    queue.add_prompts(prompts, args.samples_per_prompt)

    meter = CpuMeter(pids)  # before py-spy starts: its own CPU is not the benchmark's
    spy, start = _py_spy(pids["queue"][0], py_spy_out), time.perf_counter()
    runs = [p.run.remote() for p in producers]
    result = ray.get(consumer.run.remote(batch_groups))
    seconds, cpu_s = time.perf_counter() - start, meter.seconds()
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        spy.wait(timeout=60)
    ray.get([p.stop.remote() for p in producers])
    ray.get(runs)
    stats = queue.stats()
    counters = queue.check_conservation()
    queue.close()
    for actor in producers + [consumer]:
        ray.kill(actor)
    return _row(put_batch, batch_groups, num_prompts * args.samples_per_prompt, seconds, cpu_s, stats, counters, result)


def _row(put_batch: int, batch_groups: int, trajectories: int, seconds: float, cpu_s: dict[str, float], stats: dict, counters: dict, result: dict) -> dict:
    """One run's result. The wall limit is the rate at which the machine's cores would be busy with this
    benchmark alone: cores ÷ the CPU seconds all its processes spend per trajectory."""
    trained = counters["trained"]
    cpu_us = {role: round(s / trained * 1e6, 1) for role, s in cpu_s.items()}
    total_s = sum(cpu_s.values())
    return {
        "put_batch": put_batch,
        "batch_groups": batch_groups,
        "trajectories": trajectories,
        "trained": trained,
        "dropped_stale": counters["dropped_stale"],
        "seconds": round(seconds, 3),
        "trajectories_per_s": round(trained / seconds, 1),
        "queue_cpu_s": round(cpu_s["queue"], 3),
        "queue_cpu_us_per_trajectory": cpu_us["queue"],
        "queue_capacity_per_cpu_s": round(trained / cpu_s["queue"], 1),
        "cpu_us_per_trajectory": {**cpu_us, "total": round(total_s / trained * 1e6, 1)},
        "cpu_cores_busy": round(total_s / seconds, 2),
        "wall_limit_trajectories_per_s": round((os.cpu_count() or 1) * trained / total_s, 1),
        "latency_p50_ms": round(stats["latency_p50_s"] * 1e3, 2),
        "latency_p99_ms": round(stats["latency_p99_s"] * 1e3, 2),
        "steps": result["steps"],
        "max_lag_versions": result["max_lag"],
        "staleness_mean": round(stats["staleness_mean"], 3),
        "conservation_ok": counters["in_flight"] == 0 and counters["dispatched"] == counters["trained"] + counters["dropped_stale"],
    }


def print_table(rows: list[dict], header: list[str]) -> None:
    widths = [max(len(h), 10) for h in header]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(row[h]).rjust(w) for h, w in zip(header, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "queue_throughput", "smoke size (~10-20 s)")
    parser.add_argument("--trajectories", type=int, default=None, help="batched run size (default 20000, quick 4000)")
    parser.add_argument("--unbatched-trajectories", type=int, default=None, help="unbatched run size (default 4000, quick 800)")
    parser.add_argument("--put-batch", type=int, default=64, help="trajectories per put in the batched run")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=64, help="groups per consumer step (64 x G=4: W1's 256 samples)")
    parser.add_argument("--small-batch-groups", type=int, default=16, help="groups per step of the second batched run")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--py-spy", default=None, metavar="TXT",
                        help="py-spy the queue actor of the batched run into TXT (collapsed stacks)")
    args = parser.parse_args()
    batched_n = args.trajectories or (4000 if args.quick else 20_000)
    unbatched_n = args.unbatched_trajectories or (800 if args.quick else 4000)

    common.set_runtime_env()
    import ray

    load_start = common.load_average()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = [
            run_once(ray, args, batched_n, args.put_batch, args.batch_groups, "batched", py_spy_out=args.py_spy),
            run_once(ray, args, unbatched_n, 1, args.batch_groups, "unbatched"),
            run_once(ray, args, batched_n, args.put_batch, args.small_batch_groups, "small-steps"),
        ]
    finally:
        ray.shutdown()

    ratio = rows[0]["trajectories_per_s"] / rows[1]["trajectories_per_s"]
    print("W4 queue: replay-queue throughput "
          f"({args.producers} producers, 1 consumer, G={args.samples_per_prompt}, B={args.batch_groups} groups/step, eta={args.max_staleness})")
    print_table(rows, [
        "put_batch", "batch_groups", "trajectories", "seconds", "trajectories_per_s", "queue_capacity_per_cpu_s", "wall_limit_trajectories_per_s",
        "cpu_cores_busy", "latency_p50_ms", "latency_p99_ms", "dropped_stale", "max_lag_versions", "steps",
    ])  # fmt: skip
    print("CPU µs per trajectory:")
    print_table([{"put_batch": r["put_batch"], "batch_groups": r["batch_groups"], **r["cpu_us_per_trajectory"]} for r in rows],
                ["put_batch", "batch_groups", *ROLES, "total"])
    print(f"batched / unbatched throughput: {ratio:.1f}x")

    result = {
        "workload": "W4 queue",
        "quick": args.quick,
        "config": {
            "producers": args.producers,
            "consumers": 1,
            "samples_per_prompt": args.samples_per_prompt,
            "batch_groups": args.batch_groups,
            "small_batch_groups": args.small_batch_groups,
            "max_staleness": args.max_staleness,
            "prompt_tokens": PROMPT_TOKENS,
            "response_tokens": RESPONSE_TOKENS,
        },
        "machine": common.machine(load_start),
        "runs": rows,
        "batched_over_unbatched": round(ratio, 2),
    }
    out = common.output_path("queue_throughput", args)
    common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
