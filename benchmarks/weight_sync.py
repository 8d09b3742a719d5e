"""W3 `sync`: weight publication from the learner to the rollout engines (benchmarks/README.md).

For each random-initialised Qwen2 preset (w3-0.5m, w3-25m, w3-125m; qwen-0.5b on request) and each engine
load mode (`rollout.weight_load`: `in_place` copies into the model's parameters, `reload` runs vLLM's
layerwise reload and re-packing): one LearnerPool rank and one RolloutPool engine (vLLM, CPU, `max_model_len`
256) in one Ray session, and every transport on them: `object_store` (safetensors buckets through Ray,
`ObjectStoreSync`), `shared_memory` (one /dev/shm segment the engine maps, `SharedMemorySync`) and
`collective` (a gloo broadcast over the engine's own process group on 127.0.0.1, `CollectiveSync`). Before
every sync the learner takes a real optimizer step on a small synthetic batch (untimed), so that the engine's
weights are really stale; then the timed part runs exactly what the controller's publish does:

    t0  learner step done -> sync.start(v + 1)    (gather + export, then every engine starts loading)
    t1  export in hand    -> sync.finish(pending) (load + set version, confirmed by every engine)
    t2  every engine serves version v + 1

Figures per size and transport: export and load seconds, total seconds, payload bytes (the fp32 tensors),
bytes/s, and that rate over a plain memory copy of the same number of bytes (torch copy into a preallocated
tensor, best of 5, measured in the same run on 2 threads and on 1, as the learner rank and the engine each
copy: 1.0 would be a sync as fast as one memcpy of the weights), and
parity = max |engine log-prob - learner log-prob| over a fixed sequence, before the sync (should be large:
the learner moved) and after it (should be ~1e-6 in fp32). Syncs alternate between the transports. Per load
mode, `decode_s`: greedy decoding of 32 prompts x up to 32 tokens after the syncs, the same work in both
modes (what the kernels each mode runs cost in generation).

With `--lora-rank R`, per size one more learner and engine: the learner trains `learner.lora` adapters of rank R
(alpha 2R) on every projection, the engine serves the base model with the adapter through vLLM's LoRA, and the
syncs (transport `lora_adapter`, `AdapterSync`) send the adapter alone, timed and checked the same way.

    python benchmarks/weight_sync.py            # all three sizes, both loads, three transports, ~10 min on 2 CPU cores (3 syncs each)
    python benchmarks/weight_sync.py --transports object_store collective shared_memory --weight-loads in_place
    python benchmarks/weight_sync.py --presets qwen-0.5b --transports shared_memory --weight-loads in_place --out ...
    python benchmarks/weight_sync.py --presets w3-125m --transports object_store shared_memory --weight-loads in_place \
        --lora-rank 16 --out benchmarks/results/weight_sync_lora.json    # the adapter sync next to the full one
    python benchmarks/weight_sync.py --quick    # smoke: w3-0.5m, in_place, 2 syncs; writes weight_sync_quick.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PRESETS = ["w3-0.5m", "w3-25m", "w3-125m"]
LARGE = ["qwen-0.5b"]  # 0.5B parameters: on request (--presets qwen-0.5b), ~16 GB of memory
TRANSPORTS = ["object_store", "shared_memory", "collective"]
LOADS = ["in_place", "reload"]  # rollout.weight_load
MAX_MODEL_LEN = 256
PROBE_LEN, PROBE_PROMPT_LEN = 64, 8


def memcpy_seconds(num_bytes: int, threads: int, repeats: int = 5) -> float:
    """Seconds of a plain copy of `num_bytes` into a preallocated buffer on `threads` threads (best of `repeats`,
    pages faulted in). The learner rank and the engine copy on one thread each (one CPU each)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return best


def synthetic_groups(vocab: int, seed: int, num_groups: int = 2, group_size: int = 4, length: int = 24):
    """A small GRPO batch with reward variance, so that one optimizer step really moves the weights."""
    import numpy as np

    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        members = []
        for i in range(group_size):
            prompt, response = rng.integers(3, vocab, 8), rng.integers(3, vocab, length)  # drawn in this order
            members.append(
                make_trajectory(
                    response, prompt_ids=prompt, group_id=f"g{seed}-{g}", prompt_id=f"p{g}", sample_index=i,
                    rollout_logprobs=-rng.random(length) * 3, finish_reason="length", reward=float(i % 2),
                )
            )
        groups.append(Group(f"g{seed}-{g}", members))
    return groups


@contextlib.contextmanager
def pools(model_dir: Path, bucket_bytes: int, timeout_s: float, transports: list[str], weight_load: str, lora_rank: int | None = None):
    """One FSDP2 learner rank and one vLLM engine (loading as `weight_load` says) on `model_dir`, and a weight
    sync of each transport; with `lora_rank`, a learner training adapters of that rank on every projection, an
    engine serving them, and the adapter sync (transport `lora_adapter`)."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import EnvConfig, LearnerConfig, LoraConfig, RolloutConfig, WeightSyncConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool
    from asyncrl.weight_sync.adapter import AdapterSync
    from asyncrl.weight_sync.collective import CollectiveSync
    from asyncrl.weight_sync.object_store import ObjectStoreSync
    from asyncrl.weight_sync.shared_memory import SharedMemorySync

    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    learner = LearnerPool(model_dir, LearnerConfig(num_ranks=1, lr=1e-3, tokens_per_microbatch=4096, lora=lora), resolve_recipe("grpo"))
    rollout, syncs = None, {}
    try:
        rollout = RolloutPool(
            str(model_dir), RolloutConfig(num_workers=1, max_requests_in_flight=8, weight_load=weight_load), EnvConfig(), queue=None,
            dtype="float32", max_model_len=MAX_MODEL_LEN, lora_rank=lora_rank, latest=lambda: syncs["lora_adapter"].latest() if "lora_adapter" in syncs else None,
        )
        rollout.start()
        kinds = {"object_store": ObjectStoreSync, "shared_memory": SharedMemorySync, "collective": functools.partial(CollectiveSync, loopback=True),
                 "lora_adapter": AdapterSync}  # fmt: skip
        kinds_config = {"lora_adapter": "object_store"}  # the adapter travels through the object store
        for t in transports:
            syncs[t] = kinds[t](learner, rollout, WeightSyncConfig(bucket_bytes=bucket_bytes, timeout_s=timeout_s, transport=kinds_config.get(t, t)), mode="streaming")
        yield learner, rollout, syncs
    finally:
        for sync in syncs.values():
            sync.shutdown()
        if rollout is not None:
            rollout.shutdown()
        learner.shutdown()


def timed_sync(sync, rollout, version: int, parity) -> dict:
    """Publish `version` and time it: export (learner side) and load (until every engine confirms)."""
    t0 = time.perf_counter()
    pending = sync.start(version)
    t1 = time.perf_counter()
    synced = sync.finish(pending)
    t2 = time.perf_counter()
    served = rollout.versions()
    if set(served.values()) != {version}:
        raise RuntimeError(f"engines serve {served} after publishing version {version}")
    return {
        "version": version, "export_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "bytes": synced.num_bytes,
        "num_buckets": synced.num_buckets, "num_tensors": synced.num_tensors, "bytes_per_s": synced.num_bytes / (t2 - t0),
        "parity_after": parity(),
    }  # fmt: skip


def decode_seconds(rollout, probe: list[int], prompts: int = 32, tokens: int = 32) -> float:
    """Seconds for the engine to decode `prompts` greedy completions of up to `tokens` tokens after the last
    sync (best of 2): the same weights and work under both load modes, so their ratio is the decode-speed
    cost or gain of the kernels each mode runs."""
    batch = [probe[: PROBE_PROMPT_LEN + i % 8] for i in range(prompts)]
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        rollout.evaluate(batch, max_tokens=tokens)
        best = min(best, time.perf_counter() - began)
    return best


def bench_preset(preset: str, model_root: Path, args: argparse.Namespace) -> list[dict]:
    """One row per engine load mode and transport: for each load mode a fresh learner and engine, then
    `syncs` timed syncs per transport, alternating transports."""
    import numpy as np

    from asyncrl.algo.sampling import RAW
    from asyncrl.models import PRESETS as MODEL_PRESETS
    from asyncrl.models import build_model
    from asyncrl.models.tokenizer import SPECIAL_TOKENS

    model_dir = build_model(preset, model_root / preset, seed=0)
    vocab = len(SPECIAL_TOKENS) + len(MODEL_PRESETS[preset].alphabet)
    probe = [1] + np.random.default_rng(123).integers(3, vocab, PROBE_LEN - 1).tolist()
    syncs = args.syncs_125m if preset in ("w3-125m", *LARGE) else args.syncs
    out = []
    runs = [(weight_load, args.transports, None) for weight_load in args.weight_loads]
    runs += [(args.weight_loads[0], ["lora_adapter"], args.lora_rank)] if args.lora_rank else []
    for weight_load, transports, lora_rank in runs:
        started = time.perf_counter()
        with pools(model_dir, args.bucket_bytes, args.timeout_s, transports, weight_load, lora_rank) as (learner, rollout, by_transport):

            def parity() -> float:
                engine = np.asarray(rollout.score(probe, PROBE_PROMPT_LEN))
                return float(np.max(np.abs(engine - np.asarray(learner.score(probe, PROBE_PROMPT_LEN, RAW)))))

            setup_s, parity_at_start, rows = time.perf_counter() - started, parity(), {t: [] for t in transports}
            version = 0
            for k in range(syncs):
                for transport, sync in by_transport.items():
                    learner.train_step(synthetic_groups(vocab, seed=version))  # the learner step (not timed)
                    parity_before, version = parity(), version + 1
                    rows[transport].append({**timed_sync(sync, rollout, version, parity), "parity_before": parity_before})
                    r = rows[transport][-1]
                    print(f"  {preset} {weight_load} {transport} sync {k + 1}/{syncs}: export {r['export_s']:.3f}s "
                          f"load {r['load_s']:.3f}s ({r['bytes'] / 1e6:.1f} MB, parity {r['parity_after']:.1e})", flush=True)  # fmt: skip
            decode_s = decode_seconds(rollout, probe)
        num_bytes = rows[transports[0]][0]["bytes"]
        memcpy_s = {threads: memcpy_seconds(num_bytes, threads) for threads in (1, 2)}
        extra = {"decode_s": decode_s} | ({"lora_rank": lora_rank} if lora_rank else {})
        out += [summarise(preset, t, weight_load, rows[t], setup_s, parity_at_start, memcpy_s) | extra for t in transports]
    return out


def summarise(preset: str, transport: str, weight_load: str, rows: list[dict], setup_s: float, parity_at_start: float,
              memcpy_s: dict[int, float]) -> dict:  # fmt: skip
    from asyncrl.models import num_parameters

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "preset": preset,
        "transport": transport,
        "weight_load": weight_load,
        "parameters": num_parameters(preset),
        "syncs": len(rows),
        "setup_s": round(setup_s, 2),
        "bytes": rows[0]["bytes"],
        "num_buckets": rows[0]["num_buckets"],
        "num_tensors": rows[0]["num_tensors"],
        "export_s_median": med("export_s"),
        "load_s_median": med("load_s"),
        "total_s_median": med("total_s"),
        "total_s_min": min(r["total_s"] for r in rows),
        "bytes_per_s_median": rows[0]["bytes"] / med("total_s"),
        "memcpy_s": memcpy_s[2],
        "memcpy_ratio": memcpy_s[2] / med("total_s"),
        "memcpy_1thread_s": memcpy_s[1],
        "memcpy_1thread_ratio": memcpy_s[1] / med("total_s"),
        "parity_at_start": parity_at_start,
        "parity_before_max": max(r["parity_before"] for r in rows),
        "parity_after_max": max(r["parity_after"] for r in rows),
        "runs": rows,
    }


def print_table(rows: list[dict]) -> None:
    header = ["preset", "load", "transport", "params", "MB moved", "export_s", "load_s", "total_s", "MB/s", "÷ memcpy", "÷ 1-thread memcpy", "parity_before", "parity_after", "decode_s"]  # fmt: skip
    table = [
        [
            r["preset"],
            r["weight_load"],
            r["transport"],
            f"{r['parameters'] / 1e6:.2f}M",
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['export_s_median']:.3f}",
            f"{r['load_s_median']:.3f}",
            f"{r['total_s_median']:.3f}",
            f"{r['bytes_per_s_median'] / 1e6:.1f}",
            f"{r['memcpy_ratio']:.3f}",
            f"{r['memcpy_1thread_ratio']:.3f}",
            f"{r['parity_before_max']:.1e}",
            f"{r['parity_after_max']:.1e}",
            f"{r['decode_s']:.3f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    print("W3 sync: learner step done -> every engine serves v+1 (median of syncs; ÷ memcpy: a copy of the same bytes)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "weight_sync", "smoke: w3-0.5m, in_place load, 2 syncs; writes weight_sync_quick.json")
    parser.add_argument("--presets", nargs="+", default=None, choices=PRESETS + LARGE)
    parser.add_argument("--transports", nargs="+", default=TRANSPORTS, choices=TRANSPORTS)
    parser.add_argument("--weight-loads", nargs="+", default=None, choices=LOADS, help="rollout.weight_load of the engine (default both; quick: in_place)")
    parser.add_argument("--syncs", type=int, default=None, help="timed syncs per size and transport (default 3, quick 2)")
    parser.add_argument("--syncs-125m", type=int, default=3, help="timed syncs for w3-125m and qwen-0.5b (lower it if the machine is slow)")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20, help="weight_sync.bucket_bytes (default 64 MiB)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--lora-rank", type=int, default=None, help="also sync a LoRA adapter of this rank (every projection) through its own engine")
    args = parser.parse_args()
    presets = args.presets or (PRESETS[:1] if args.quick else PRESETS)
    args.weight_loads = args.weight_loads or (LOADS[:1] if args.quick else LOADS)
    args.syncs = args.syncs or (2 if args.quick else 3)

    common.set_runtime_env()
    import ray

    load_start = common.load_average()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-w3-") as tmp:
            for preset in presets:
                rows += bench_preset(preset, Path(tmp), args)
    finally:
        ray.shutdown()

    print_table(rows)
    result = {
        "workload": "W3 sync",
        "quick": args.quick,
        "config": {
            "learner_ranks": 1,
            "rollout_workers": 1,
            "dtype": "float32",
            "bucket_bytes": args.bucket_bytes,
            "transports": args.transports,
            "weight_loads": args.weight_loads,
            "max_model_len": MAX_MODEL_LEN,
            "lora_rank": args.lora_rank,
            "probe_tokens": PROBE_LEN,
            "probe_prompt_len": PROBE_PROMPT_LEN,
        },
        "machine": common.machine(load_start),
        "sizes": rows,
    }
    out = common.output_path("weight_sync", args)
    common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
