"""Endpoint overhead per call: the OpenAI-compatible endpoint (docs/openai_endpoint.md) vs the engine called directly.

One in-process vLLM CPU engine (`ascii-1m`, random init) and its endpoint (`qwen2_tools` template). Each round makes
the same generation twice, one after the other, with the same seed (so the same tokens): once through the real
`openai` client, HTTP, request checking, template rendering, tokenization, episode capture and the response body
(episodes of 8 calls: every call extends the captured conversation), and once as `Engine.generate` on the prompt
tokens the endpoint fed the engine. The overhead is the endpoint's own time per call: its wall time minus the engine
time inside it (`TimedEngine`); the direct call checks the tokens and gives the engine's time for scale.

    python benchmarks/openai_endpoint.py           # 40 rounds, ~2 min on 2 CPU cores (engine start included)
    python benchmarks/openai_endpoint.py --quick   # 8 rounds, writes openai_endpoint_quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
CALLS_PER_EPISODE = 8


class TimedEngine:
    """The engine as the endpoint sees it, timing each `generate`: the endpoint's own cost of a call is its wall
    time minus the engine time inside it (paired within one call, so a busy machine's engine noise cancels)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.last_s = 0.0

    async def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return await self.engine.generate(*args, **kwargs)
        finally:
            self.last_s = time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


async def one_round(c, engine: TimedEngine, spec, messages: list[dict], episode: str, seed: int) -> tuple[float, float, float, int]:
    """(endpoint seconds, engine seconds inside it, direct seconds, prompt tokens) of one generation made both ways."""
    from asyncrl.testing import make_prompt, make_request

    start = time.perf_counter()
    r = await c.chat.completions.create(
        model="m", messages=messages, max_tokens=MAX_TOKENS, seed=seed, logprobs=True, extra_headers={"X-Episode-Id": episode}
    )
    endpoint_s, inside_s = time.perf_counter() - start, engine.last_s
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"turn {seed}"}]
    request = make_request(make_prompt(f"direct-{seed}", r.prompt_token_ids))
    start = time.perf_counter()
    direct = await engine.engine.generate(request, dataclasses.replace(spec, seed=seed))
    direct_s = time.perf_counter() - start
    assert direct.response_ids.tolist() == r.choices[0].token_ids, "the same seed must give the same tokens"
    return endpoint_s, inside_s, direct_s, len(r.prompt_token_ids)


async def measure(model_dir: Path, rounds: int) -> dict:
    import openai
    from transformers import PreTrainedTokenizerFast

    from asyncrl.models.templates import load_chat_template
    from asyncrl.rollout.engine import Engine, SamplingSpec
    from asyncrl.rollout.openai_capture import ChatRenderer
    from asyncrl.rollout.openai_server import OpenAIServer

    engine = Engine(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    await engine.start()
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0)
    server = OpenAIServer(TimedEngine(engine), ChatRenderer(PreTrainedTokenizerFast.from_pretrained(model_dir), load_chat_template("qwen2_tools")), spec, MAX_MODEL_LEN, "m")
    c = openai.AsyncOpenAI(base_url=f"{await server.start()}/v1", api_key="unused", max_retries=0)
    await one_round(c, server.engine, spec, [{"role": "user", "content": "Hi."}], "warm-up", seed=0)  # connection, template
    results, drift = [], 0
    for e in range(rounds // CALLS_PER_EPISODE):
        messages = [{"role": "user", "content": "Count with me."}]
        for i in range(CALLS_PER_EPISODE):
            results.append(await one_round(c, server.engine, spec, messages, f"bench-{e}", seed=1 + e * CALLS_PER_EPISODE + i))
        drift += (await server.finish_episode(f"bench-{e}")).drifts
    await server.stop()
    await engine.shutdown()
    own = sorted(e - i for e, i, _, _ in results)
    return {
        "rounds": len(results), "calls_per_episode": CALLS_PER_EPISODE, "max_tokens": MAX_TOKENS, "drift": drift,
        "prompt_tokens_max": max(p for *_, p in results),
        "endpoint_ms_median": 1e3 * statistics.median(e for e, _, _, _ in results),
        "direct_ms_median": 1e3 * statistics.median(d for _, _, d, _ in results),
        "endpoint_minus_direct_ms_median": 1e3 * statistics.median(e - d for e, _, d, _ in results),
        "overhead_ms_median": 1e3 * statistics.median(own),
        "overhead_ms_p90": 1e3 * own[int(0.9 * (len(own) - 1))],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_options(parser, "openai_endpoint", "8 rounds (smoke)")
    args = parser.parse_args()
    common.set_runtime_env()
    from asyncrl.models import build_model

    load_start = common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model("ascii-1m", Path(tmp) / "model", seed=0)
        result = asyncio.run(measure(model_dir, 8 if args.quick else 40))
    result["machine"] = common.machine(load_start)
    common.write_json(common.output_path("openai_endpoint", args), result)
    print("| calls | endpoint ms (median) | engine ms direct (median) | endpoint overhead ms (median) | overhead ms (p90) | drift | load |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['rounds']} | {result['endpoint_ms_median']:.1f} | {result['direct_ms_median']:.1f} | "
          f"{result['overhead_ms_median']:.1f} | {result['overhead_ms_p90']:.1f} | {result['drift']} | {load_start:.0f} |")


if __name__ == "__main__":
    main()
