"""Engine start-up in a rollout worker: the engine core forked from a preloaded server against vLLM's spawn.

An `Engine` on the tiny model started inside a fresh Ray actor with the rollout worker's CPU share, as the pool
starts one (and replaces a dead one), alternating:
  server   `rollout.fork_engine_core: true` (the default): `Engine.start` first starts a fork server that
           imports vLLM's engine core while the actor imports vLLM, and vLLM's engine core is forked from it
           (`vllm_compat.start_engine_core_server`);
  spawn    `false` (the code before): vLLM spawns its engine core, a fresh interpreter that imports vLLM again.
Reported per start: seconds from the actor's creation to the engine serving (its imports, the engine core's
start, the model load and the warm-up), and the engine start alone; the median of each variant, and their ratio.

    python benchmarks/engine_start.py [--pairs 3] [--quick]     # ~2 min for three pairs on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

ROLLOUT_CPUS = 1.0  # RolloutConfig.num_cpus_per_worker (default)
MAX_MODEL_LEN = 64  # W1's prompts; the warm-up decodes up to the context, so a short one keeps the start-up's other parts in view


def start_in_actor(model_dir: str, variant: str) -> dict:
    """Create a fresh actor, start an `Engine` in it, and time both; the actor is killed afterwards."""
    import ray

    @ray.remote(num_cpus=ROLLOUT_CPUS)
    class Starter:
        async def start(self, model_dir: str, variant: str) -> float:
            from asyncrl.rollout.engine import Engine

            engine = Engine(model_dir, name="start", max_model_len=MAX_MODEL_LEN, kv_cache_gib=1, fork_core=variant == "server")
            began = time.perf_counter()
            await engine.start()
            return time.perf_counter() - began

    created = time.perf_counter()
    actor = Starter.remote()
    try:
        engine_s = ray.get(actor.start.remote(model_dir, variant), timeout=600)
        return {"variant": variant, "serving_s": time.perf_counter() - created, "engine_start_s": engine_s}
    finally:
        ray.kill(actor)
        time.sleep(2)  # let the killed actor's processes go before the next one starts


def summarise(runs: list[dict]) -> dict:
    """Median seconds per variant, and server ÷ spawn."""
    out = {}
    for variant in ("server", "spawn"):
        mine = [r for r in runs if r["variant"] == variant]
        out[variant] = {key: statistics.median(r[key] for r in mine) for key in ("serving_s", "engine_start_s")}
    out["server_over_spawn"] = {key: out["server"][key] / out["spawn"][key] for key in ("serving_s", "engine_start_s")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "engine_start", "one pair")
    parser.add_argument("--pairs", type=int, default=3, help="server / spawn pairs, alternating which goes first")
    args = parser.parse_args()
    pairs = 1 if args.quick else args.pairs
    common.set_runtime_env()
    import ray

    from asyncrl.models import build_model

    load_start = common.load_average()
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-start-") as tmp:
        model_dir = str(build_model("tiny-0.3m", Path(tmp) / "model", seed=0))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            for i in range(pairs):
                for variant in (("server", "spawn") if i % 2 == 0 else ("spawn", "server")):
                    runs.append(start_in_actor(model_dir, variant))
                    print(f"{variant:>6}: serving {runs[-1]['serving_s']:.1f} s after the actor's creation "
                          f"(engine start {runs[-1]['engine_start_s']:.1f} s)", flush=True)
        finally:
            ray.shutdown()
    summary = summarise(runs)
    ratio = summary["server_over_spawn"]
    print(f"median: server {summary['server']['serving_s']:.1f} s, spawn {summary['spawn']['serving_s']:.1f} s "
          f"to serving ({ratio['serving_s']:.2f}x); engine start {ratio['engine_start_s']:.2f}x")
    out = common.output_path("engine_start", args)
    common.write_json(out, {"machine": common.machine(load_start), "pairs": pairs, "max_model_len": MAX_MODEL_LEN,
                            "rollout_cpus": ROLLOUT_CPUS, "runs": runs, **summary})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
