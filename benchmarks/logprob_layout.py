"""Engine client CPU per request: vLLM's flat log-prob lists (what `Engine.generate` asks for) against its
default dict and `Logprob` object per token (#17 point 4, per-token overhead).

One in-process `Engine` (add-1m, the W1 model), rounds of `--requests` requests of `--tokens` tokens each
(64 in flight, EOS ignored), the layout alternating round by round. Reported: the median CPU time of this
process (the engine client: vLLM's output processing and asyncrl's own; the engine-core process is not counted)
per request for each layout over the rounds after the first two, and their ratio. One run, one machine:
compare the two columns, not absolute figures across runs.

    python benchmarks/logprob_layout.py            # 128 and 6 tokens, 256 requests x 22 rounds each
    python benchmarks/logprob_layout.py --quick    # smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import common  # benchmarks/common.py: a script's own folder is on sys.path

IN_FLIGHT = 64
WARM_ROUNDS = 2
PROMPT = [1, 5, 6, 14, 7, 8, 15]  # <bos> 12+34=


async def one_round(engine, k: int, requests: int, tokens: int) -> float:
    """CPU microseconds of this process per request over `requests` requests."""
    import numpy as np

    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.testing import make_prompt, make_request

    slots = asyncio.Semaphore(IN_FLIGHT)
    spec = SamplingSpec(max_tokens=tokens, temperature=1.0, ignore_eos=True)

    async def one(i: int) -> None:
        async with slots:
            t = await engine.generate(make_request(make_prompt(f"r{k}-{i}", PROMPT)), spec)
            assert len(t.response_ids) == tokens and np.isfinite(t.rollout_logprobs).all()

    began = time.process_time()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return (time.process_time() - began) / requests * 1e6


async def measure(tokens: int, args) -> dict:
    import numpy as np

    from asyncrl.models import build_model
    from asyncrl.rollout.engine import Engine

    flat_params = Engine._sampling_params

    def dict_params(self, spec, **kwargs):
        return flat_params(self, spec, **{**kwargs, "flat": False})

    engine = Engine(str(build_model("add-1m", tempfile.mkdtemp(), seed=0)), name="bench", max_model_len=256, max_num_seqs=IN_FLIGHT, kv_cache_gib=1)
    await engine.start()
    us: dict[str, list[float]] = {"flat": [], "dict": []}
    try:
        for k in range(args.rounds):
            layout = "flat" if k % 2 == 0 else "dict"
            Engine._sampling_params = flat_params if layout == "flat" else dict_params
            cpu = await one_round(engine, k, args.requests, tokens)
            if k >= WARM_ROUNDS:
                us[layout].append(cpu)
    finally:
        Engine._sampling_params = flat_params
        await engine.shutdown()
    flat, dicts = float(np.median(us["flat"])), float(np.median(us["dict"]))
    return {"tokens": tokens, "flat_us_per_request": round(flat), "dict_us_per_request": round(dicts), "dict_over_flat": round(dicts / flat, 3),
            "flat_rounds_us": [round(x) for x in us["flat"]], "dict_rounds_us": [round(x) for x in us["dict"]]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "logprob_layout", "smoke size (~1 min)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 6], help="response lengths, one measurement each")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (default 256, quick 64)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per length, layouts alternating (default 22, quick 6)")
    args = parser.parse_args()
    args.requests = args.requests or (64 if args.quick else 256)
    args.rounds = args.rounds or (6 if args.quick else 22)

    common.set_runtime_env()
    load_start = common.load_average()
    runs = [asyncio.run(measure(tokens, args)) for tokens in args.tokens]
    print(f"engine client CPU per request (median of {args.rounds - WARM_ROUNDS} rounds of {args.requests} requests)")
    print(f"{'tokens':>8}{'flat us':>10}{'dict us':>10}{'dict/flat':>11}")
    for r in runs:
        print(f"{r['tokens']:>8}{r['flat_us_per_request']:>10}{r['dict_us_per_request']:>10}{r['dict_over_flat']:>11}")
    result = {"workload": "engine client, log-prob layout", "quick": args.quick, "runs": runs,
              "config": {"requests_per_round": args.requests, "rounds": args.rounds, "warm_rounds": WARM_ROUNDS, "in_flight": IN_FLIGHT, "model": "add-1m"},
              "machine": common.machine(load_start)}  # fmt: skip
    out = common.output_path("logprob_layout", args)
    common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
