"""A limit model for this machine: the best W2 throughput its engine and its learner allow, and how close
the last W2 run (`benchmarks/async_speedup.py`) came to it.

Measured pieces, each alone, on W2's workload (tiny-0.3m, log-normal lengths, the same prompt stream):
  E       engine tokens/s: every trained request submitted at once to one vLLM engine (`Engine`), in a Ray
          task with the rollout worker's CPU share (`rollout.num_cpus_per_worker` = 1: Ray sets
          OMP_NUM_THREADS=1), as W2's "engine alone".
  g_b     seconds to generate batch b alone (its prompts_per_step x G requests at once, waiting for the
          longest): what sync pays per batch, stragglers included.
  t_b     seconds of one optimizer step on batch b with `RankStep` on a plain module (no Ray, no FSDP),
          `learner.num_cpus_per_rank` = 1 torch thread, each mode's recipe.
  V       vLLM's own tokens/s on the same requests (raw `AsyncLLM`, same sampling, one request of n = G per
          group as `Engine` sends them, FINAL_ONLY): the
          overhead of `Engine` is E / V (goal >= 0.95). Both runs also give the client process's CPU per
          request (all its threads; the engine core is a child process): the rollout worker's share.
Tokens are W2's: prompt + response tokens of the trained samples (n_b in batch b).

Model:
  straggler factor  s = sum_b g_b / (sum_b n_b / E)      (batch-at-a-time generation vs the saturated engine)
  sync limit          = sum_b n_b / sum_b (g_b + t_b)    (generate a batch, then train on it; weight sync free)
  learner rate      L = sum_b n_b / sum_b t_b
  capacity          c = E_t / E + L_t / L                (E_t, L_t: both sides' rates measured while they run
                                                          at full load at the same time for 30 s; 1 = they
                                                          time-share one core, 2 = each has a free core)
  streaming limit     = min(E, L, c / (1/E + 1/L))      (generation and training overlap: the best split of
                                                          what the machine gives both, each side's share
                                                          trading linearly against the other's)
min(E, L), the limit if each side kept its alone rate while both run, and the shared-core bound 1 / (1/E +
1/L) (c = 1) are reported next to it.

The stragglers under `stale_policy: wait` (the default): a group admitted at version a must be trained by
version a + eta, so the learner waits for its longest sample, whose pace is the engine's decode step, not its
throughput. Measured: the decode step's seconds with n sequences running (n = 1 to all W2 lets in flight,
(eta + 1) x prompts_per_step x G), fitted as a + b n. `wait_bound.replay_wait` replays the queue's admission
(with W2's `buffer.max_ready_batches`) and wait gate on W2's prompt stream with that engine and the learner's
rate (each slowed as measured together while the other runs):
  wait limit          = min(streaming limit, replayed tokens/s)
  model check           the same replay with eta = 0 is sync on that engine, next to the sync limit above
W2 streaming under `wait` is reported against the wait limit; under `drop` / `continue` (the learner never
waits) against the streaming limit. W2's figures are reported as fractions of the limits (goals: sync
>= 0.9, streaming >= 0.8), as measured and load-normalised by E_w2 / E (W2 times the same engine-alone run
in its session).

W1 (`add`, 6-token answers) has a limit model of its own in samples/s, built from a streaming run's trained
batches by `benchmarks/learning_add.py` after its runs (`w1_limit`): E counts the groups the zero-variance filter
discards as engine work, and sync's g_b generates each batch together with those groups.

    python benchmarks/limits.py [--w2 benchmarks/results/async_speedup.json] [--quick]   # ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

import async_speedup as w2  # W2's workload, its engine jobs and its per-mode config
import wait_bound

from asyncrl.staleness import Staleness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Ray's worker pickles the engine side by value: it gets W2's constants, not the `async_speedup` module.
MAX_MODEL_LEN, MAX_REQUESTS_IN_FLIGHT, ROLLOUT_CPUS = w2.MAX_MODEL_LEN, w2.MAX_REQUESTS_IN_FLIGHT, w2.ROLLOUT_CPUS
REPEATS = 2
"""Engine and vLLM-alone runs are interleaved this many times; the best of each counts (shared machine)."""
STEP_TOKENS = 128
"""Tokens each sequence decodes when the decode step's cost is measured (`measure_step_cost`)."""
TOGETHER_S = 30.0
"""Seconds engine and learner run at once to measure what the machine gives both (`measure_together`)."""


@dataclass
class EngineFigures:
    """What the engine-side Ray task measured (seconds), and the trajectories the learner then trains on."""

    engine_s: list[float]
    vllm_s: list[float]
    batch_s: list[float]
    trajectories: list
    engine_cpu_s: list[float] = field(default_factory=list)
    vllm_cpu_s: list[float] = field(default_factory=list)
    """CPU seconds of the client process (every thread; the engine core is a child process, not counted)
    during each all-at-once run: the rollout worker's share of the per-request work."""
    step_s: dict[int, float] = field(default_factory=dict)
    """Sequences decoding at once -> seconds per decode step (best of `REPEATS`), `measure_step_cost`."""


# ---------------------------------------------------------------------------------------------------
# Engine side: one Ray task with the rollout worker's CPU share.


def engine_side(model_dir: Path, batches: list[list], weight_load: str, concurrency: list[int]) -> EngineFigures:
    return asyncio.run(measure_engine(model_dir, batches, weight_load, concurrency))


async def measure_engine(model_dir: Path, batches: list[list], weight_load: str, concurrency: list[int]) -> EngineFigures:
    """All requests at once through `Engine` and through raw vLLM (interleaved), then batch by batch. With
    `weight_load: in_place` (the default) the engine runs unpacked `F.linear` layers, raw vLLM its oneDNN-packed
    ones, so E / V holds the kernels' difference too; `reload` gives both the same kernels."""
    engine = w2_spec(model_dir, weight_load).build_engine("limit")
    await engine.start()
    jobs = [job for batch in batches for job in batch]
    figures, raw = EngineFigures([], [], [], []), None
    try:
        raw = await start_raw_vllm(model_dir, jobs[:1])
        for _ in range(REPEATS):
            cpu = time.process_time()
            figures.vllm_s.append(await raw_generate_s(raw, jobs))
            figures.vllm_cpu_s.append(time.process_time() - cpu)
            cpu = time.process_time()
            seconds, figures.trajectories = await engine_generate(engine, jobs)
            figures.engine_cpu_s.append(time.process_time() - cpu)
            figures.engine_s.append(seconds)
        for batch in batches:
            figures.batch_s.append((await engine_generate(engine, batch))[0])
        figures.step_s = await measure_step_cost(engine, jobs, concurrency)
    finally:
        if raw is not None:
            raw.shutdown()
        await engine.shutdown()
    return figures


def w2_spec(model_dir: Path, weight_load: str):
    """The rollout worker's spec of W2's engines (`WorkerSpec.build_engine` builds the engine a run would)."""
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.worker import WorkerSpec

    rollout = RolloutConfig(max_requests_in_flight=MAX_REQUESTS_IN_FLIGHT, max_model_len=MAX_MODEL_LEN, weight_load=weight_load)
    return WorkerSpec(str(model_dir), rollout, max_model_len=MAX_MODEL_LEN)


async def measure_step_cost(engine, jobs: list, concurrency: list[int]) -> dict[int, float]:
    """Seconds per decode step with n sequences running, for each n: W2's first n requests (whole groups, so
    a group still travels as one request of n = G), each generating `STEP_TOKENS` tokens, all at once."""
    import dataclasses

    seconds: dict[int, float] = {}
    for _ in range(REPEATS):
        for n in concurrency:
            chosen = [(request, dataclasses.replace(spec, max_tokens=STEP_TOKENS, ignore_eos=True)) for request, spec in jobs[:n]]
            elapsed, _ = await engine_generate(engine, chosen)
            seconds[n] = min(seconds.get(n, float("inf")), elapsed / STEP_TOKENS)
    return seconds


async def engine_generate(engine, jobs: list) -> tuple[float, list]:
    began = time.perf_counter()
    trajectories = await asyncio.gather(*(engine.generate(request, spec) for request, spec in jobs))
    seconds = time.perf_counter() - began
    failed = [t for t in trajectories if t.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].failure}")
    return seconds, trajectories


async def start_raw_vllm(model_dir: Path, warm_up: list):
    """A second engine with `Engine`'s engine arguments, driven through vLLM's API only (the baseline);
    `warm_up` pays its one-off first-request cost, as `Engine.start` does."""
    from asyncrl.rollout import vllm_compat

    args = vllm_compat.engine_args(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_REQUESTS_IN_FLIGHT)
    llm = vllm_compat.create_async_llm(args)
    await raw_generate_s(llm, warm_up)
    return llm


async def raw_generate_s(llm, jobs: list) -> float:
    """Seconds for vLLM alone to finish `jobs` submitted at once, one request of `n` samples per group (as
    `Engine` sends a group's samples), one final output per request, the sampled tokens' log-probs included
    (what `Engine` asks for)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    groups: dict[str, list] = {}
    for request, spec in jobs:
        groups.setdefault(request.group_id, []).append((request, spec))

    async def one(i: int, request, spec, n: int) -> None:
        params = SamplingParams(
            n=n, max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            ignore_eos=spec.ignore_eos, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async for _ in llm.generate({"prompt_token_ids": list(request.prompt.prompt_ids)}, params, f"raw-{i}-{time.time_ns()}"):
            pass

    began = time.perf_counter()
    await asyncio.gather(*(one(i, *members[0], len(members)) for i, members in enumerate(groups.values())))
    return time.perf_counter() - began


def measure_engine_side(model_dir: Path, batches: list[list], weight_load: str, concurrency: list[int]) -> EngineFigures:
    import ray

    print("engine side (engine, vLLM alone, batch by batch) ...", flush=True)
    task = ray.remote(num_cpus=ROLLOUT_CPUS, max_calls=1)(engine_side)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        return ray.get(task.remote(model_dir, batches, weight_load, concurrency))
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------------
# Learner side: this process, no Ray, no FSDP.


def learner_seconds(model_dir: Path, mode: str, args, groups_per_batch: list[list], out_dir: Path) -> list[float]:
    """Seconds of each optimizer step of `mode`'s recipe on the given batches (one plain fp32 module, the
    learner's torch threads), as `LearnerWorker` steps them but without its process group."""
    train = learner_steps(model_dir, mode, args, out_dir)
    seconds = []
    for b, groups in enumerate(groups_per_batch):
        began = time.perf_counter()
        train(groups, b)
        seconds.append(time.perf_counter() - began)
    return seconds


def learner_steps(model_dir: Path, mode: str, args, out_dir: Path):
    """`train(groups, step)`: one optimizer step of `mode`'s W2 recipe (`rank_trainer`)."""
    return rank_trainer(w2.mode_config(mode, args, out_dir, model_dir), model_dir)


def rank_trainer(cfg, model_dir: Path, threads: int | None = None):
    """`train(groups, step)`: one optimizer step of `cfg`'s recipe with `RankStep` on plain fp32 modules (the
    critic's too when the recipe has one), as `LearnerWorker` steps it but without FSDP or a process group, on
    `threads` torch threads (default: the learner's `num_cpus_per_rank`)."""
    import torch

    from asyncrl.algo.sampling import SamplingDistribution
    from asyncrl.learner.batch import build_batch, split_mini_batches
    from asyncrl.learner.pool import recipe_from_config
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    learner, recipe = cfg.learner, recipe_from_config(cfg)
    torch.set_num_threads(threads or max(1, int(learner.num_cpus_per_rank)))
    torch.manual_seed(learner.seed)
    state = build_train_state(learner, str(model_dir), torch.device("cpu"))
    sampling = SamplingDistribution(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
    step = RankStep(state, learner, recipe, sampling, torch.device("cpu"), lambda tensor, _op: tensor)
    return lambda groups, b: step.train(split_mini_batches(build_batch(groups, recipe), learner.mini_batches, recipe), b)


# ---------------------------------------------------------------------------------------------------
# Both at once: how much of the two sides' alone rates the machine gives them together.


class EngineLoad:
    """A warm engine (built from a rollout worker's spec) in a Ray actor with the rollout worker's CPU share,
    generating the same requests pass after pass (all at once) for a given time; it counts tokens or samples."""

    def __init__(self, spec, jobs: list, unit: str = "tokens") -> None:
        self.spec, self.jobs, self.unit, self.engine = spec, jobs, unit, None

    async def start(self) -> None:
        self.engine = self.spec.build_engine("limit")
        await self.engine.start()
        await engine_generate(self.engine, self.jobs)  # the first pass of these shapes is slower (cold)

    async def run_for(self, seconds: float) -> tuple[int, float]:
        """(tokens or samples, seconds) of the passes finished within `seconds` (the other side ran all that time);
        on a machine so busy that none did, of the first pass (`together` keeps the other side going that long)."""
        began, done, elapsed = time.perf_counter(), 0, 0.0
        while True:
            _, trajectories = await engine_generate(self.engine, self.jobs)
            if time.perf_counter() - began > seconds and done:
                return done, elapsed
            done += len(trajectories) if self.unit == "samples" else sum(t.num_tokens for t in trajectories)
            elapsed = time.perf_counter() - began

    async def stop(self) -> None:
        await self.engine.shutdown()


def measure_together(model_dir: Path, batches: list[list], groups: list[list], args, out_dir: Path, seconds: float) -> dict:
    """W2's engine and learner (streaming's recipe) at full load at the same time for `seconds`."""
    print(f"engine and learner together ({seconds:.0f} s) ...", flush=True)
    train = learner_steps(model_dir, "streaming", args, out_dir)
    batch_tokens = [sum(t.num_tokens for g in batch for t in g.trajectories) for batch in groups]
    jobs = [job for batch in batches for job in batch]
    return together(w2_spec(model_dir, args.weight_load), jobs, ROLLOUT_CPUS, train, groups, batch_tokens, seconds, "tokens")


def together(spec, jobs: list, engine_cpus: float, train, groups: list[list], batch_units: list[int], seconds: float, unit: str) -> dict:
    """An engine built from `spec` generating `jobs` (with `engine_cpus` Ray CPUs) and `train` stepping through
    `groups` (batch b holds `batch_units[b]` tokens or samples, `unit`) in this process, both at full load at
    the same time for `seconds`: each side's rate over the work it finished within that time (at least its first
    pass or step: a busy machine can make the first outlast a short window, and the other side goes on till both
    have one)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        load = ray.remote(num_cpus=engine_cpus)(EngineLoad).remote(spec, jobs, unit)
        ray.get(load.start.remote())
        engine_run = load.run_for.remote(seconds)
        began, done, elapsed, b = time.perf_counter(), 0, 0.0, 0
        while time.perf_counter() - began < seconds or not done or not ray.wait([engine_run], timeout=0)[0]:
            train(groups[b % len(groups)], b)
            if time.perf_counter() - began <= seconds or not done:
                done, elapsed = done + batch_units[b % len(groups)], time.perf_counter() - began
            b += 1
        engine_done, engine_elapsed = ray.get(engine_run)
        ray.get(load.stop.remote())
    finally:
        ray.shutdown()
    if not engine_elapsed or not elapsed:
        raise RuntimeError(f"together: no whole engine pass or learner step within {seconds} s")
    return {"seconds": seconds, f"engine_{unit}_per_s": engine_done / engine_elapsed, f"learner_{unit}_per_s": done / elapsed, "learner_steps": b}


def singles(groups: list) -> list:
    """The same samples as groups of one (sao's batches: one rollout per prompt)."""
    from asyncrl.types import Group

    return [Group(f"{g.group_id}/{i}", [t]) for g in groups for i, t in enumerate(g.trajectories)]


def groups_of(trajectories: list, args) -> list[list]:
    """The trained trajectories as W2's batches of `prompts_per_step` groups of G (in stream order)."""
    from asyncrl.types import Group

    g, per_batch = args.samples_per_prompt, args.prompts_per_step
    groups = [Group(trajectories[i].group_id, list(trajectories[i : i + g])) for i in range(0, len(trajectories), g)]
    return [groups[i : i + per_batch] for i in range(0, len(groups), per_batch)]


# ---------------------------------------------------------------------------------------------------
# W1: the limit of the batches a streaming `add` run trained (called by learning_add.py after its runs).

W1_TOGETHER_S = 20.0


def w1_limit(cfg, model_dir: Path, batches: list[list], step_s: dict[str, list[float]], generated_per_trained: float,
             together_s: float = W1_TOGETHER_S) -> dict:
    """W1's limit model: the same formulas as W2's in trained samples/s, on `batches` (lists of `Group`s a run of
    `cfg` trained; batch 0 is the warm-up). `step_s[threads]`: the learner's seconds per batch alone
    (`rank_trainer`) with 1 thread (an asynchronous mode's learner) and, for the sync limit, 2: sync's own
    recipe on the same batches (its engine and learner take turns).
    `generated_per_trained`: samples the run generated per sample it trained (groups the zero-variance filter
    discards are generated too). E: the engine alone on every request at once, in a Ray task with the rollout
    worker's CPUs, over `generated_per_trained`; g_b: batch b generated alone with as many more groups as the
    filter discards (the best sync can do: every group it needs started at once)."""
    import ray

    from asyncrl.rollout.worker import WorkerSpec

    if __name__ != "__main__":  # imported by learning_add.py: Ray's workers cannot import this script's module
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spec = WorkerSpec(str(model_dir), cfg.rollout, cfg.env, dtype=cfg.model.dtype, max_model_len=cfg.rollout.max_model_len, seed=cfg.seed)
    groups = [g for batch in batches for g in batch]
    per_sync_batch = round(len(batches[0]) * generated_per_trained)
    sync_batches = [[groups[(b * len(batches[0]) + k) % len(groups)] for k in range(per_sync_batch)] for b in range(len(batches))] if "2" in step_s else []
    print("W1 limit: engine alone ...", flush=True)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=cfg.rollout.num_cpus_per_worker, max_calls=1)(w1_engine_side)
        engine = ray.get(task.remote(spec, w1_jobs(groups, cfg.rollout), [w1_jobs(batch, cfg.rollout) for batch in sync_batches]))
    finally:
        ray.shutdown()
    print(f"W1 limit: engine and learner together ({together_s:.0f} s) ...", flush=True)
    sizes = [sum(len(g.trajectories) for g in batch) for batch in batches]
    train = rank_trainer(cfg, model_dir, threads=1)
    both = together(spec, w1_jobs(groups, cfg.rollout), cfg.rollout.num_cpus_per_worker, train, batches, sizes, together_s, "samples")
    return w1_model(engine, sizes, step_s, both, generated_per_trained)


def w1_jobs(groups: list, rollout) -> list:
    """(request, sampling) of every sample of `groups`, the prompt as the run sent it, sampled as it was."""
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.testing import make_request
    from asyncrl.types import Prompt

    spec = SamplingSpec.from_rollout_config(rollout)
    jobs = []
    for g in groups:
        first = g.trajectories[0]
        prompt = Prompt(first.prompt_id, [int(i) for i in first.prompt_ids], "")
        jobs += [(make_request(prompt, group_id=g.group_id, sample_index=k, group_size=len(g.trajectories)), spec) for k in range(len(g.trajectories))]
    return jobs


def w1_engine_side(spec, jobs: list, sync_batches: list[list]) -> dict:
    """Seconds for all `jobs` at once (`REPEATS` passes; the first is cold) and for each of `sync_batches` alone."""

    async def measure() -> dict:
        engine = spec.build_engine("limit")
        await engine.start()
        try:
            engine_s = [(await engine_generate(engine, jobs))[0] for _ in range(REPEATS)]
            return {"engine_s": engine_s, "generated": len(jobs), "batch_s": [(await engine_generate(engine, batch))[0] for batch in sync_batches]}
        finally:
            await engine.shutdown()

    return asyncio.run(measure())


def w1_model(engine: dict, sizes: list[int], step_s: dict[str, list[float]], both: dict, generated_per_trained: float) -> dict:
    """E, L (1 learner thread), capacity c and the asynchronous limit min(E, L, c / (1/E + 1/L)) in trained
    samples/s, and with 2-thread steps in `step_s` the sync limit; batch 0 (the learner's warm-up) is left out of
    the learner's sums."""
    samples = sum(sizes[1:])
    generated_rate = engine["generated"] / min(engine["engine_s"])
    engine_rate = generated_rate / generated_per_trained
    learner_rate = samples / sum(step_s["1"][1:])
    capacity = both["engine_samples_per_s"] / generated_rate + both["learner_samples_per_s"] / learner_rate
    return {
        "samples": samples,
        "generated_per_trained": generated_per_trained,
        "engine_generated_samples_per_s": generated_rate,
        "engine_samples_per_s": engine_rate,
        "learner_samples_per_s": {threads: samples / sum(s[1:]) for threads, s in step_s.items()},
        "together": both,
        "concurrency_capacity": capacity,
        "min_e_l_samples_per_s": min(engine_rate, learner_rate),
        "shared_core_bound_samples_per_s": 1.0 / (1.0 / engine_rate + 1.0 / learner_rate),
        "capacity_bound_samples_per_s": capacity / (1.0 / engine_rate + 1.0 / learner_rate),
        "limit_samples_per_s": min(engine_rate, learner_rate, capacity / (1.0 / engine_rate + 1.0 / learner_rate)),
        "bound_by": "engine" if engine_rate <= learner_rate else "learner",
        **({"sync_limit_samples_per_s": samples / (sum(engine["batch_s"][1:]) + sum(step_s["2"][1:]))} if "2" in step_s else {}),
        "measured": {"engine_s": engine["engine_s"], "sync_batch_s": engine["batch_s"], "step_s": step_s, "batch_samples": sizes},
    }


# ---------------------------------------------------------------------------------------------------
# The model.


def limit_model(engine: EngineFigures, batch_tokens: list[int], train_s: dict[str, list[float]], requests: int, together: dict) -> dict:
    """The formulas of the module docstring; `train_s` per mode (sync, streaming, and sao: its learner steps a
    critic too); `requests` per all-at-once run; `together`: both sides' rates measured at the same time
    (`measure_together`, streaming's learner). sao's limit is streaming's formula with sao's learner rate and the
    same capacity c."""
    tokens = sum(batch_tokens)
    rates = {mode: tokens / sum(s) for mode, s in train_s.items()}
    engine_rate = tokens / min(engine.engine_s)
    learner_rate = tokens / sum(train_s["streaming"])
    capacity = together["engine_tokens_per_s"] / engine_rate + together["learner_tokens_per_s"] / learner_rate
    return {
        "tokens": tokens,
        "engine_tokens_per_s": engine_rate,
        "vllm_alone_tokens_per_s": tokens / min(engine.vllm_s),
        "engine_over_vllm": min(engine.vllm_s) / min(engine.engine_s),
        "client_cpu_ms_per_request": {"engine": 1000 * min(engine.engine_cpu_s) / requests, "vllm_alone": 1000 * min(engine.vllm_cpu_s) / requests},
        "straggler_factor": sum(engine.batch_s) / (tokens / engine_rate),
        "gen_batch_s_mean": sum(engine.batch_s) / len(engine.batch_s),
        "train_batch_s_mean": {mode: sum(s) / len(s) for mode, s in train_s.items()},
        "learner_tokens_per_s": rates,
        "sync_limit_tokens_per_s": tokens / (sum(engine.batch_s) + sum(train_s["sync"])),
        "streaming_limit_tokens_per_s": min(engine_rate, learner_rate),
        "streaming_bound_by": "engine" if engine_rate <= learner_rate else "learner",
        "shared_core_bound_tokens_per_s": 1.0 / (1.0 / engine_rate + 1.0 / learner_rate),
        "together": together,
        "concurrency_capacity": capacity,
        "streaming_limit_measured_tokens_per_s": min(engine_rate, learner_rate, capacity / (1.0 / engine_rate + 1.0 / learner_rate)),
        **({"sao_limit_tokens_per_s": min(engine_rate, sao, capacity / (1.0 / engine_rate + 1.0 / sao))} if (sao := rates.get("sao")) else {}),
    }


def wait_limit(model: dict, step_s: dict[int, float], stream: wait_bound.Stream, args) -> dict:
    """The replay of `stale_policy: wait` (module docstring) on the measured decode step and learner rates;
    its eta = 0 twin (sync) checks the replay against the sync limit measured batch by batch."""
    cost = wait_bound.fit_step_cost(sorted(step_s.items()))
    together, rates = model["together"], model["learner_tokens_per_s"]
    common_args = {"steps": args.steps, "batch_groups": args.prompts_per_step, "step_cost": cost, "max_in_flight": MAX_REQUESTS_IN_FLIGHT}
    streaming = wait_bound.replay_wait(
        stream, eta=args.max_staleness, learner_rate=rates["streaming"], ready_lead=args.max_ready_batches, **common_args,
        engine_slowdown=model["engine_tokens_per_s"] / together["engine_tokens_per_s"],
        learner_slowdown=rates["streaming"] / together["learner_tokens_per_s"],
    )
    sync = wait_bound.replay_wait(stream, eta=0, learner_rate=rates["sync"], **common_args)
    limit = min(model["streaming_limit_measured_tokens_per_s"], streaming["tokens_per_s"])
    return {
        "step_s": {str(n): s for n, s in sorted(step_s.items())},
        "step_cost": {"fixed_s": cost.fixed_s, "per_sequence_s": cost.per_sequence_s},
        "replay_streaming": streaming,
        "replay_sync": sync,
        "replay_sync_over_sync_limit": sync["tokens_per_s"] / model["sync_limit_tokens_per_s"],
        "wait_limit_tokens_per_s": limit,
        "wait_limit_over_sync_limit": limit / model["sync_limit_tokens_per_s"],
    }


def w2_fractions(model: dict, w2_result: dict | None) -> dict:
    """Each W2 mode's trained tokens/s over its limit (sao against its own, its critic's cost included), as
    measured, and load-normalised: W2 measured the same engine-alone run E in its own session, so
    E_w2 / E_here says how much faster the shared machine was then; the normalised fraction assumes the
    learner sped up alike (a first-order correction: the fractions are only exact back to back). Streaming
    under `wait` is held to the wait limit (`model["wait"]`), under `drop` / `continue` to the capacity limit."""
    if w2_result is None:
        return {}
    capacity = model["streaming_limit_measured_tokens_per_s"]
    waits = w2_result.get("config", {}).get("stale_policy", "wait") == "wait" and "wait" in model
    limits = {"sync": model["sync_limit_tokens_per_s"], "streaming": model["wait"]["wait_limit_tokens_per_s"] if waits else capacity,
              "sao": model.get("sao_limit_tokens_per_s", capacity)}
    speed = w2_result["engine_alone"]["tokens_per_s"] / model["engine_tokens_per_s"]
    return {
        m["mode"]: {
            "trained_tokens_per_s": m["trained_tokens_per_s"],
            "fraction_of_limit": m["trained_tokens_per_s"] / limits[m["mode"]],
            "machine_speed_ratio": speed,
            "fraction_of_limit_load_normalised": m["trained_tokens_per_s"] / (limits[m["mode"]] * speed),
            **({"fraction_of_min_e_l": m["trained_tokens_per_s"] / model["streaming_limit_tokens_per_s"]} if m["mode"] != "sync" else {}),
            **({"fraction_of_capacity_limit": m["trained_tokens_per_s"] / capacity} if m["mode"] == "streaming" else {}),
            "limit": "wait" if m["mode"] == "streaming" and waits else ("capacity" if m["mode"] == "streaming" else m["mode"]),
        }
        for m in w2_result["modes"]
        if m["mode"] in limits
    }


# ---------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "limits", "4 batches instead of W2's (~1 min); writes limits_quick.json")
    parser.add_argument("--w2", type=Path, default=common.RESULTS / "async_speedup.json",
                        help="the W2 result to report against; its workload config is the one measured here")
    parser.add_argument("--weight-load", default="in_place", choices=["in_place", "reload"], help="the Engine's rollout.weight_load")
    args = parser.parse_args()
    w2_result = json.loads(args.w2.read_text()) if args.w2.exists() else None
    config = (w2_result or {}).get("config", {})
    length = config.get("length_distribution", {})
    # The defaults of async_speedup.py, overridden by the W2 result's own config: the same workload.
    args.steps = 4 if args.quick else config.get("steps", 24)
    args.prompts_per_step = config.get("prompts_per_step", 8)
    args.samples_per_prompt = config.get("samples_per_prompt", 4)
    args.max_staleness = config.get("max_staleness", 4)
    args.median_tokens, args.p99_tokens, args.seed = length.get("median", 32.0), length.get("p99", 512.0), 0
    args.stale_policy = config.get("stale_policy")  # W2's, recorded in its result (None: the config's default)
    args.max_ready_batches = config.get("max_ready_batches")  # absent from results that predate it: eta alone
    args.w2_result = w2_result
    return args


def batches_of_jobs(args, stream: list) -> list[list]:
    """W2's trained requests (the first steps x prompts_per_step prompts, G samples each), batch by batch."""
    from asyncrl.config import RolloutConfig

    prompts = stream[: args.steps * args.prompts_per_step]
    rollout = RolloutConfig(max_requests_in_flight=MAX_REQUESTS_IN_FLIGHT, max_model_len=MAX_MODEL_LEN)
    per_batch = args.prompts_per_step
    return [w2.engine_jobs(prompts[i : i + per_batch], args.samples_per_prompt, rollout) for i in range(0, len(prompts), per_batch)]


def step_concurrency(args) -> list[int]:
    """Sequences decoding at once at which the decode step is timed: 1 up to all W2 lets in flight."""
    window = Staleness(args.max_staleness).admission_limit(0, args.prompts_per_step)  # groups admitted at version 0
    most = min(MAX_REQUESTS_IN_FLIGHT, window * args.samples_per_prompt)
    return sorted({1, args.samples_per_prompt, most // 4, most})


def replay_stream(prompts: list, args) -> wait_bound.Stream:
    """W2's whole prompt stream (what admission runs ahead into too) as the replay's groups."""
    g = args.samples_per_prompt
    lengths = [int(p.extra_info["max_tokens"]) for p in prompts]
    return wait_bound.Stream(lengths, [g * (len(p.prompt_ids) + n) for p, n in zip(prompts, lengths)], g)


def print_summary(model: dict, fractions: dict) -> None:
    print(f"engine {model['engine_tokens_per_s']:.0f} tokens/s ({model['engine_over_vllm']:.3f} of vLLM alone, "
          f"{model['vllm_alone_tokens_per_s']:.0f}); straggler factor {model['straggler_factor']:.2f}; learner "
          + ", ".join(f"{m} {r:.0f}" for m, r in model["learner_tokens_per_s"].items()) + " tokens/s")
    cpu = model["client_cpu_ms_per_request"]
    print(f"client CPU per request: Engine {cpu['engine']:.3f} ms, vLLM alone {cpu['vllm_alone']:.3f} ms")
    together = model["together"]
    print(f"together: engine {together['engine_tokens_per_s']:.0f}, learner {together['learner_tokens_per_s']:.0f} tokens/s; "
          f"concurrency capacity {model['concurrency_capacity']:.2f} (1: one shared core, 2: two free cores)")
    print(f"limits: sync {model['sync_limit_tokens_per_s']:.0f} tokens/s, streaming {model['streaming_limit_measured_tokens_per_s']:.0f} "
          f"(min(E, L) {model['streaming_limit_tokens_per_s']:.0f}, {model['streaming_bound_by']}-bound; one shared core: "
          f"{model['shared_core_bound_tokens_per_s']:.0f})")
    wait = model["wait"]
    print(f"decode step {1000 * wait['step_cost']['fixed_s']:.2f} ms + {1000 * wait['step_cost']['per_sequence_s']:.3f} ms per sequence; "
          f"wait limit {wait['wait_limit_tokens_per_s']:.0f} tokens/s (replay: learner waits {wait['replay_streaming']['learner_wait_s']:.1f} s "
          f"of {wait['replay_streaming']['seconds']:.1f}); replayed sync {wait['replay_sync']['tokens_per_s']:.0f} = "
          f"{wait['replay_sync_over_sync_limit']:.2f} of the sync limit")
    for mode, f in fractions.items():
        print(f"W2 {mode}: {f['trained_tokens_per_s']:.0f} tokens/s = {f['fraction_of_limit']:.2f} of its limit; "
              f"{f['fraction_of_limit_load_normalised']:.2f} load-normalised (engine alone {f['machine_speed_ratio']:.2f}x faster in W2's session)")


def main() -> None:
    args = parse_args()
    common.set_runtime_env()
    from asyncrl.models import build_model

    began, load_start = time.perf_counter(), common.load_average()
    with tempfile.TemporaryDirectory(prefix="asyncrl-limits-") as tmp:
        model_dir = build_model("tiny-0.3m", Path(tmp) / "model", seed=args.seed)
        stream = w2.workload(args, model_dir)
        batches = batches_of_jobs(args, stream)
        engine = measure_engine_side(model_dir, batches, args.weight_load, step_concurrency(args))
        groups = groups_of(engine.trajectories, args)
        print("learner alone (sync's, streaming's and sao's recipes) ...", flush=True)
        train_s = {mode: learner_seconds(model_dir, mode, args, groups, Path(tmp) / "runs") for mode in ("sync", "streaming")}
        train_s["sao"] = learner_seconds(model_dir, "sao", args, [singles(batch) for batch in groups], Path(tmp) / "runs")
        together = measure_together(model_dir, batches, groups, args, Path(tmp) / "runs", TOGETHER_S / (4 if args.quick else 1))
    batch_tokens = [sum(t.num_tokens for g in batch for t in g.trajectories) for batch in groups]
    model = limit_model(engine, batch_tokens, train_s, len(engine.trajectories), together)
    model["wait"] = wait_limit(model, engine.step_s, replay_stream(stream, args), args)
    fractions = w2_fractions(model, args.w2_result)
    print_summary(model, fractions)
    result = {
        "workload": "W2 tail (limit model)",
        "quick": args.quick,
        "config": {"steps": args.steps, "prompts_per_step": args.prompts_per_step, "samples_per_prompt": args.samples_per_prompt,
                   "engine_cpus": ROLLOUT_CPUS, "learner_threads": 1, "engine_weight_load": args.weight_load, "max_ready_batches": args.max_ready_batches, "w2_result": str(args.w2) if args.w2_result else None},
        "machine": common.machine(load_start),
        "measured": {"engine_s": engine.engine_s, "vllm_alone_s": engine.vllm_s, "gen_batch_s": engine.batch_s,
                     "engine_client_cpu_s": engine.engine_cpu_s, "vllm_client_cpu_s": engine.vllm_cpu_s,
                     "train_batch_s": train_s, "batch_tokens": batch_tokens},
        "model": model,
        "w2_fraction_of_limit": fractions,
        "total_s": round(time.perf_counter() - began, 1),
    }
    out = common.output_path("limits", args)
    common.write_json(out, result)
    print(f"wrote {out} ({result['total_s']:.0f}s in all)")


if __name__ == "__main__":
    main()
