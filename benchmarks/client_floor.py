"""The rollout worker's CPU floor at W1 (#17 point 4): the engine client's CPU per sample through `Engine`
against vLLM's own client doing the least the rollout needs.

W1-shaped rounds: `--prompts` prompts x G samples of `--tokens` tokens each (EOS ignored, temperature 1,
the sampled tokens' log-probs), all submitted at once, as a W1 hand-out reaches a worker. Alternating round
by round in one process:
  engine     `Engine.generate` per sample (a group's samples travel as one request of n = G), trajectories
             built as in a run;
  vllm       raw `AsyncLLM.generate`, one request of n = G per group, one final output per request
             (FINAL_ONLY), log-probs in vLLM's flat layout: the least work a client of vLLM can do for them.
Reported: the median and the mean CPU time of this process per sample over the rounds after the first two
(the engine core is a child process, not counted), the cores each needs at a given sample rate, and the
seconds spent in full garbage collections. vLLM alone is the floor of a rollout worker built on vLLM's client;
Ray's worker threads and the queue calls come on top. `Engine.start` freezes the start-up heap
(`vllm_compat.freeze_startup_heap`); `--no-freeze` undoes that first, as the code before it ran.

    python benchmarks/client_floor.py [--rate 346] [--no-freeze]     # ~1 min; --quick: smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import common  # benchmarks/common.py: a script's own folder is on sys.path

WARM_ROUNDS = 2
MAX_MODEL_LEN = 64


def jobs_of(prompts: int, group: int, tokens: int) -> list:
    """(request, sampling) per sample: `prompts` `add` prompts, `group` samples each."""
    import random

    from asyncrl.envs.data import add_prompt
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.testing import make_request

    rng = random.Random(0)
    spec = SamplingSpec(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    chosen = [add_prompt(TOKENIZER, rng.randint(0, 999), rng.randint(0, 999), f"c-{i}") for i in range(prompts)]
    return [(make_request(p, sample_index=k, group_size=group), spec) for p in chosen for k in range(group)]


async def engine_round(engine, jobs: list) -> None:
    trajectories = await asyncio.gather(*(engine.generate(request, spec) for request, spec in jobs))
    failed = [t.failure for t in trajectories if t.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} samples failed, e.g. {failed[0]}")


async def vllm_round(llm, jobs: list, k: int) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from asyncrl.rollout.vllm_compat import token_input

    groups: dict[str, list] = {}
    for request, spec in jobs:
        groups.setdefault(request.group_id, []).append((request, spec))

    async def one(i: int, request, spec, n: int) -> None:
        params = SamplingParams(n=n, max_tokens=spec.max_tokens, temperature=spec.temperature, ignore_eos=True, logprobs=0,
                                flat_logprobs=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        async for _ in llm.generate(token_input(list(request.prompt.prompt_ids)), params, f"raw-{k}-{i}"):
            pass

    await asyncio.gather(*(one(i, *members[0], len(members)) for i, members in enumerate(groups.values())))


class FullCollections:
    """Seconds this process spends in full (generation 2) garbage collections, from `gc.callbacks`."""

    def __init__(self) -> None:
        import gc

        self.seconds, self.count, self._began = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds, self.count = self.seconds + time.perf_counter() - self._began, self.count + 1


async def measure(args) -> dict:
    import numpy as np

    from asyncrl.rollout import vllm_compat
    from asyncrl.rollout.engine import Engine

    engine = Engine(MODEL_DIR, name="floor", max_model_len=MAX_MODEL_LEN, max_num_seqs=256, kv_cache_gib=1)
    await engine.start()
    if args.no_freeze:
        vllm_compat.unfreeze_heap()
    llm = vllm_compat.create_async_llm(vllm_compat.engine_args(MODEL_DIR, max_model_len=MAX_MODEL_LEN, max_num_seqs=256))
    jobs = jobs_of(args.prompts, args.group, args.tokens)
    us: dict[str, list[float]] = {"engine": [], "vllm": []}
    collections = FullCollections()
    try:
        for k in range(args.rounds):
            side = "engine" if k % 2 == 0 else "vllm"
            began = time.process_time()
            await (engine_round(engine, jobs) if side == "engine" else vllm_round(llm, jobs, k))
            if k == WARM_ROUNDS:
                collections.seconds, collections.count = 0.0, 0
            if k >= WARM_ROUNDS:
                us[side].append((time.process_time() - began) / len(jobs) * 1e6)
    finally:
        llm.shutdown()
        await engine.shutdown()
    medians = {side: float(np.median(v)) for side, v in us.items()}
    means = {side: float(np.mean(v)) for side, v in us.items()}
    return {"us_per_sample": medians, "mean_us_per_sample": means, "engine_over_vllm": medians["engine"] / medians["vllm"],
            "cores_at_rate": {side: m * 1e-6 * args.rate for side, m in means.items()},
            "full_collections": {"count": collections.count, "seconds": collections.seconds, "rounds": args.rounds - WARM_ROUNDS},
            "frozen_objects": engine.frozen_objects, "freeze": not args.no_freeze,
            "rounds_us": {side: [round(x) for x in v] for side, v in us.items()}}  # fmt: skip


def main() -> None:
    global MODEL_DIR, TOKENIZER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "client_floor", "smoke size (~1 min)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per round (W1: learner.prompts_per_step)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (W1: G = 8)")
    parser.add_argument("--tokens", type=int, default=6, help="tokens per sample (W1: rollout.max_tokens)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, the two clients alternating (default 22, quick 6)")
    parser.add_argument("--no-freeze", action="store_true", help="unfreeze the heap after the engine's start (the code before it froze)")
    parser.add_argument("--rate", type=float, default=346.0, help="samples/s at which to express the cores (W1's trained rate in profile_run.py)")
    args = parser.parse_args()
    args.rounds = args.rounds or (6 if args.quick else 22)

    common.set_runtime_env()
    from transformers import AutoTokenizer

    from asyncrl.models import build_model

    load_start = common.load_average()
    MODEL_DIR = str(build_model("add-1m", tempfile.mkdtemp(), seed=0))
    TOKENIZER = AutoTokenizer.from_pretrained(MODEL_DIR)
    r = asyncio.run(measure(args))
    us, mean, cores, full = r["us_per_sample"], r["mean_us_per_sample"], r["cores_at_rate"], r["full_collections"]
    print(f"client CPU per sample ({args.rounds - WARM_ROUNDS} rounds of {args.prompts} x {args.group} samples, {args.tokens} tokens, heap "
          f"{'frozen' if r['freeze'] else 'not frozen'}): median / mean Engine {us['engine']:.0f} / {mean['engine']:.0f} us, vLLM alone "
          f"{us['vllm']:.0f} / {mean['vllm']:.0f} us; at {args.rate:.0f} samples/s: {cores['engine']:.3f} / {cores['vllm']:.3f} cores; "
          f"{full['count']} full collections, {full['seconds']:.2f} s")  # fmt: skip
    result = {"workload": "engine client floor, W1-shaped", "quick": args.quick, **r,
              "config": {"prompts": args.prompts, "group": args.group, "tokens": args.tokens, "rounds": args.rounds, "warm_rounds": WARM_ROUNDS, "rate": args.rate, "model": "add-1m"},
              "machine": common.machine(load_start)}  # fmt: skip
    out = args.out or common.RESULTS / f"client_floor{'_no_freeze' if args.no_freeze else ''}{'_quick' if args.quick else ''}.json"
    common.write_json(out, result)
    print(f"wrote {out}")


MODEL_DIR = TOKENIZER = None

if __name__ == "__main__":
    main()
