"""W3 `sync`: weight publication from the learner to the rollout engines (benchmarks/README.md).

For each random-initialised Qwen2 preset (w3-0.5m, w3-25m, w3-125m): one LearnerPool rank and one
RolloutPool engine (vLLM, CPU, `max_model_len` 256) in one Ray session. Before every sync the learner takes
a real optimizer step on a small synthetic batch (untimed), so that the engine's weights are really stale;
then the timed part runs exactly what the controller's publish does (`ObjectStoreSync`):

    t0  learner step done -> sync.start(v + 1)    (gather + pack + ray.put, then every engine starts loading)
    t1  refs in hand      -> sync.finish(pending) (fetch + load + set version, confirmed by every engine)
    t2  every engine serves version v + 1

Figures per size: export and load seconds, total seconds, bytes moved (sum of the safetensors bucket sizes),
bytes/s, that rate over this machine's plain memory-copy bandwidth (numpy copy of a 256 MB array, best of 5,
measured in the same run), and parity = max |engine log-prob - learner log-prob| over a fixed sequence,
before the sync (should be large: the learner moved) and after it (should be ~1e-6 in fp32).

    python benchmarks/weight_sync.py            # all three sizes, ~3-5 min on 2 CPU cores (3 syncs each)
    python benchmarks/weight_sync.py --quick    # w3-0.5m only (smoke), writes weight_sync_quick.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PRESETS = ["w3-0.5m", "w3-25m", "w3-125m"]
MAX_MODEL_LEN = 256
PROBE_LEN, PROBE_PROMPT_LEN = 64, 8


def memcpy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by a plain numpy copy of a `num_bytes` array (best of `repeats`)."""
    import numpy as np

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


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
def pools(model_dir: Path, bucket_bytes: int, timeout_s: float):
    """One FSDP2 learner rank and one vLLM engine on `model_dir`, joined by an object-store weight sync."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import EnvConfig, LearnerConfig, RolloutConfig, WeightSyncConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool
    from asyncrl.weight_sync.object_store import ObjectStoreSync

    learner = LearnerPool(model_dir, LearnerConfig(num_ranks=1, lr=1e-3, tokens_per_microbatch=4096), resolve_recipe("grpo"))
    rollout = None
    try:
        rollout = RolloutPool(
            str(model_dir), RolloutConfig(num_workers=1, max_requests_in_flight=8), EnvConfig(), queue=None,
            dtype="float32", max_model_len=MAX_MODEL_LEN,
        )
        rollout.start()
        yield learner, rollout, ObjectStoreSync(learner, rollout, WeightSyncConfig(bucket_bytes=bucket_bytes, timeout_s=timeout_s), mode="streaming")
    finally:
        if rollout is not None:
            rollout.shutdown()
        learner.shutdown()


def timed_sync(sync, rollout, version: int, parity) -> dict:
    """Publish `version` and time it: export (learner side), load (until every engine confirms), and an
    object-store fetch of the buckets alone (a diagnostic)."""
    import ray

    t0 = time.perf_counter()
    pending = sync.start(version)
    t1 = time.perf_counter()
    synced = sync.finish(pending)
    t2 = time.perf_counter()
    served = rollout.versions()
    if set(served.values()) != {version}:
        raise RuntimeError(f"engines serve {served} after publishing version {version}")
    t3 = time.perf_counter()
    bucket_sizes = [len(b) for b in ray.get(sync.latest().refs)]
    total_bytes = sum(bucket_sizes)
    return {
        "version": version, "export_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "bytes": total_bytes,
        "payload_bytes": synced.num_bytes, "num_buckets": len(bucket_sizes), "num_tensors": synced.num_tensors,
        "bytes_per_s": total_bytes / (t2 - t0), "driver_fetch_s": time.perf_counter() - t3, "parity_after": parity(),
    }  # fmt: skip


def bench_preset(preset: str, model_root: Path, syncs: int, bucket_bytes: int, timeout_s: float) -> dict:
    import numpy as np

    from asyncrl.algo.sampling import RAW
    from asyncrl.models import PRESETS as MODEL_PRESETS
    from asyncrl.models import build_model
    from asyncrl.models.tokenizer import SPECIAL_TOKENS

    model_dir = build_model(preset, model_root / preset, seed=0)
    vocab = len(SPECIAL_TOKENS) + len(MODEL_PRESETS[preset].alphabet)
    probe = [1] + np.random.default_rng(123).integers(3, vocab, PROBE_LEN - 1).tolist()
    started = time.perf_counter()
    with pools(model_dir, bucket_bytes, timeout_s) as (learner, rollout, sync):

        def parity() -> float:
            engine = np.asarray(rollout.score(probe, PROBE_PROMPT_LEN))
            return float(np.max(np.abs(engine - np.asarray(learner.score(probe, PROBE_PROMPT_LEN, RAW)))))

        setup_s, parity_at_start, rows = time.perf_counter() - started, parity(), []
        for k in range(syncs):
            learner.train_step(synthetic_groups(vocab, seed=k))  # the learner step (not timed)
            parity_before = parity()
            rows.append({**timed_sync(sync, rollout, k + 1, parity), "parity_before": parity_before})
            r = rows[-1]
            print(f"  {preset} sync {k + 1}/{syncs}: export {r['export_s']:.3f}s load {r['load_s']:.3f}s "
                  f"({r['bytes'] / 1e6:.1f} MB, parity {r['parity_after']:.1e})", flush=True)  # fmt: skip
    return summarise(preset, rows, setup_s, parity_at_start)


def summarise(preset: str, rows: list[dict], setup_s: float, parity_at_start: float) -> dict:
    from asyncrl.models import num_parameters

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "preset": preset,
        "parameters": num_parameters(preset),
        "syncs": len(rows),
        "setup_s": round(setup_s, 2),
        "bytes": rows[0]["bytes"],
        "payload_bytes": rows[0]["payload_bytes"],
        "num_buckets": rows[0]["num_buckets"],
        "num_tensors": rows[0]["num_tensors"],
        "export_s_median": med("export_s"),
        "load_s_median": med("load_s"),
        "total_s_median": med("total_s"),
        "total_s_min": min(r["total_s"] for r in rows),
        "driver_fetch_s_median": med("driver_fetch_s"),
        "bytes_per_s_median": rows[0]["bytes"] / med("total_s"),
        "parity_at_start": parity_at_start,
        "parity_before_max": max(r["parity_before"] for r in rows),
        "parity_after_max": max(r["parity_after"] for r in rows),
        "runs": rows,
    }


def print_table(rows: list[dict], memcpy_bps: float) -> None:
    header = ["preset", "params", "MB moved", "buckets", "export_s", "load_s", "total_s", "MB/s", "÷ memcpy", "parity_before", "parity_after"]
    table = [
        [
            r["preset"],
            f"{r['parameters'] / 1e6:.2f}M",
            f"{r['bytes'] / 1e6:.1f}",
            str(r["num_buckets"]),
            f"{r['export_s_median']:.3f}",
            f"{r['load_s_median']:.3f}",
            f"{r['total_s_median']:.3f}",
            f"{r['bytes_per_s_median'] / 1e6:.1f}",
            f"{r['memcpy_ratio']:.3f}",
            f"{r['parity_before_max']:.1e}",
            f"{r['parity_after_max']:.1e}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    print(f"W3 sync: learner step done -> every engine serves v+1 (median of syncs; memcpy {memcpy_bps / 1e9:.2f} GB/s)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "weight_sync", "w3-0.5m only (smoke); writes weight_sync_quick.json")
    parser.add_argument("--presets", nargs="+", default=None, choices=PRESETS)
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs per size")
    parser.add_argument("--syncs-125m", type=int, default=3, help="timed syncs for w3-125m (lower it if the machine is slow)")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20, help="weight_sync.bucket_bytes (default 64 MiB)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    presets = args.presets or (PRESETS[:1] if args.quick else PRESETS)

    common.set_runtime_env()
    import ray

    load_start = common.load_average()
    memcpy_before = memcpy_bandwidth()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-w3-") as tmp:
            for preset in presets:
                syncs = args.syncs_125m if preset == "w3-125m" else args.syncs
                rows.append(bench_preset(preset, Path(tmp), syncs, args.bucket_bytes, args.timeout_s))
    finally:
        ray.shutdown()
    memcpy_bps = max(memcpy_before, memcpy_bandwidth())
    for r in rows:
        r["memcpy_ratio"] = r["bytes_per_s_median"] / memcpy_bps

    print_table(rows, memcpy_bps)
    result = {
        "workload": "W3 sync",
        "quick": args.quick,
        "config": {
            "learner_ranks": 1,
            "rollout_workers": 1,
            "dtype": "float32",
            "bucket_bytes": args.bucket_bytes,
            "transport": "ray object store (ObjectStoreSync)",
            "max_model_len": MAX_MODEL_LEN,
            "probe_tokens": PROBE_LEN,
            "probe_prompt_len": PROBE_PROMPT_LEN,
        },
        "machine": common.machine(load_start),
        "memcpy_bytes_per_s": memcpy_bps,
        "sizes": rows,
    }
    out = common.output_path("weight_sync", args)
    common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
