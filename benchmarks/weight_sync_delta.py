"""W3 `delta`: full vs delta weight payloads (`weight_sync.delta`, `asyncrl.weights.delta`) at the W3 shapes.

Part `wire` (no Ray, no engine): the random-initialised Qwen2 preset's state in the engines' dtype (bf16 and
fp32); a copy with a given fraction of every tensor's elements changed (each moved by one unit in the last
place, at random positions: the smallest change a sync must carry); then, timed:

    full    learner: pack every tensor into safetensors buckets    engine: unpack them
    delta   learner: `DeltaEncoder.encode` (bit compare, sparse     engine: unpack, `DeltaMirror.apply` (scatter,
            or dense per tensor, CRCs) + pack                               CRCs, digest check)

Figures per dtype and fraction: payload bytes (the buckets, headers included) and seconds on each side, and
their ratio to the full payload. The break-even in bytes is where a tensor goes dense (1/3 of its elements in
bf16, 1/2 in fp32); the one in seconds is measured. The object store's own copy (ray.put, the engine's fetch)
and the engine's load are not in `wire`: they scale with the bytes (full) or the changed tensors (delta).

Part `export` (point 3 of issue 49): a 2-rank FSDP2 learner (gloo, Ray) exports into the shared-memory segment
either by gathering the full state on rank 0, which writes it (every export before; now the first), or by every
rank writing its own dim-0 rows (`LearnerWorker.export_shared`, every later export): seconds per export.

Part `e2e` (on request: it starts a vLLM engine): one learner rank and one engine (fp32, loading in place) through
Ray's object store: full syncs (`ObjectStoreSync`) against `DeltaSync` when every element changed (a fp32 step) and
when nothing did, timed from `start` to the engine serving the version, parity after each.

Part `steps`: what fraction of the elements a real optimizer step changes, by dtype: one AdamW step (lr 1e-6,
1e-5, 1e-4; weight decay 0) of the preset on a random-token language-model loss, then the fraction of elements
whose bits changed in bf16 and in fp32, and the delta's bytes over the full payload's for that step.

    python benchmarks/weight_sync_delta.py                         # w3-125m, all parts (~5 min on 2 busy cores)
    python benchmarks/weight_sync_delta.py --presets qwen-0.5b --parts export --out benchmarks/results/weight_export_0.5b.json
    python benchmarks/weight_sync_delta.py --presets w3-25m --fractions 0 0.01 1
    python benchmarks/weight_sync_delta.py --presets w3-25m --parts e2e --out benchmarks/results/weight_sync_delta_e2e.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FRACTIONS = [0.0, 0.001, 0.01, 0.1, 0.3, 0.5, 1.0]
LRS = [1e-6, 1e-5, 1e-4]
DTYPES = ["bfloat16", "float32"]


def load_state(preset: str, root: Path):
    """The preset's HF model (random init, seed 0) and its state under HF names, tied head included."""
    from asyncrl.models import build_model
    from asyncrl.weights.buckets import hf_named_tensors
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model(preset, root / preset, seed=0))
    return model, dict(hf_named_tensors(model))


def nudged(state: dict, fraction: float, seed: int) -> dict:
    """A copy of `state` with `fraction` of every tensor's elements moved by one unit in the last place."""
    import torch

    from asyncrl.weights.delta import _bits

    g, out = torch.Generator().manual_seed(seed), {}
    for name, t in state.items():
        t = t.clone()
        k = round(fraction * t.numel())
        if k:
            _bits(t)[torch.randperm(t.numel(), generator=g)[:k]] += 1
        out[name] = t
    return out


def wire_row(state: dict, dtype: str, fraction: float, bucket_bytes: int, repeats: int = 2) -> dict:
    """Bytes and seconds of one full and one delta payload of `fraction` changed elements; each stage's seconds the
    best of `repeats` (the machine is shared: the minimum is the least disturbed)."""
    import torch

    from asyncrl.weights.buckets import pack_buckets, unpack_bucket
    from asyncrl.weights.delta import DeltaEncoder, DeltaMirror

    base = {n: t.detach().to(getattr(torch, dtype)).contiguous() for n, t in state.items()}
    new = nudged(base, fraction, seed=1)
    best = {"full_learner_s": float("inf"), "full_engine_s": float("inf"), "delta_learner_s": float("inf"),
            "delta_engine_s": float("inf")}  # fmt: skip
    for _ in range(repeats):
        encoder, mirror = DeltaEncoder(), DeltaMirror()
        mirror.apply({k: v for b in pack_buckets(encoder.encode(base, 1), bucket_bytes) for k, v in unpack_bucket(b).items()})
        t0 = time.perf_counter()
        full = pack_buckets(new.items(), bucket_bytes)
        t1 = time.perf_counter()
        for b in full:
            unpack_bucket(b)
        t2 = time.perf_counter()
        delta = pack_buckets(encoder.encode(new, 2), bucket_bytes)
        t3 = time.perf_counter()
        header, _ = mirror.apply({k: v for b in delta for k, v in unpack_bucket(b).items()})
        t4 = time.perf_counter()
        assert mirror.digest == encoder.digest
        for key, seconds in zip(best, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            best[key] = min(best[key], seconds)
    row = {
        "dtype": dtype, "fraction": fraction, "full_bytes": sum(map(len, full)), "delta_bytes": sum(map(len, delta)),
        **best, "changed_tensors": header.changed, "sparse_tensors": header.sparse, "tensors": len(new), "repeats": repeats,
    }  # fmt: skip
    row["bytes_ratio"] = row["delta_bytes"] / row["full_bytes"]
    row["seconds_ratio"] = (best["delta_learner_s"] + best["delta_engine_s"]) / (best["full_learner_s"] + best["full_engine_s"])
    return row


def step_rows(model, lrs: list[float], seed: int = 0) -> list[dict]:
    """For each lr, one AdamW step from the same weights: the fraction of elements whose bits changed."""
    import torch

    from asyncrl.weights.buckets import hf_named_tensors, pack_buckets
    from asyncrl.weights.delta import DeltaEncoder, _bits

    initial = {n: t.clone() for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (4, 64), generator=g)
    rows = []
    for lr in lrs:
        model.load_state_dict(initial)
        before = {n: t.clone() for n, t in hf_named_tensors(model)}
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        after = dict(hf_named_tensors(model))
        for dtype in DTYPES:
            d = getattr(torch, dtype)
            changed = sum(int((_bits(before[n].to(d)) != _bits(after[n].to(d))).sum()) for n in before)
            total = sum(t.numel() for t in before.values())
            encoder = DeltaEncoder()
            encoder.encode({n: t.to(d) for n, t in before.items()}, 1)
            delta = sum(map(len, pack_buckets(encoder.encode({n: t.to(d) for n, t in after.items()}, 2), 1 << 30)))
            full = sum(t.numel() * t.element_size() for t in encoder.base.values())
            rows.append({"lr": lr, "dtype": dtype, "changed_fraction": changed / total, "bytes_ratio": delta / full})
        model.zero_grad(set_to_none=True)
    return rows


def export_rows(preset: str, root: Path, syncs: int) -> list[dict]:
    """A 2-rank FSDP2 learner (gloo) on the preset: `export_shared` seconds, the gather on rank 0 against every
    rank writing its own rows (alternating, after the first export that fixes the layout), and rank 0's peak
    RSS growth is not measured (the gather holds one full copy of the weights on rank 0 at once; rows none)."""
    import ray

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.models import build_model
    from asyncrl.weight_sync.shared_memory import _unlink_slots, segment_root

    model_dir = build_model(preset, root / preset, seed=0)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    learner = LearnerPool(model_dir, LearnerConfig(num_ranks=2, lr=1e-5, tokens_per_microbatch=4096), resolve_recipe("grpo"))
    segment, rows = segment_root(), []
    try:
        record = learner._call("export_shared", segment, 0, True)[0]
        for k in range(syncs):
            for gather in (True, False):
                version = 1 + 2 * k + (0 if gather else 1)
                began = time.perf_counter()
                learner._call("export_shared", segment, version, gather)
                rows.append({"preset": preset, "ranks": 2, "path": "gather" if gather else "rows",
                             "seconds": time.perf_counter() - began, "bytes": record.num_bytes})  # fmt: skip
                print(f"{preset} export_shared {rows[-1]['path']}: {rows[-1]['seconds']:.3f} s", flush=True)
    finally:
        learner.shutdown()
        _unlink_slots(segment)
        ray.shutdown()
    return rows


def e2e_rows(preset: str, root: Path, syncs: int, timeout_s: float = 300.0) -> list[dict]:
    """One learner rank and one vLLM engine (fp32, in place), Ray's object store: `syncs` full syncs after a learner
    step (`ObjectStoreSync`), then `DeltaSync`: its first (full) sync, `syncs` deltas after a learner step (fp32:
    every element changes, the worst case) and `syncs` deltas with no step between (nothing changed, the best).
    Timed as W3 times a sync: `start` to every engine serving the version."""
    import numpy as np
    import ray

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import EnvConfig, LearnerConfig, RolloutConfig, WeightSyncConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.models import PRESETS as MODEL_PRESETS
    from asyncrl.models import build_model
    from asyncrl.models.tokenizer import SPECIAL_TOKENS
    from asyncrl.rollout.pool import RolloutPool
    from asyncrl.weight_sync.delta import DeltaSync
    from asyncrl.weight_sync.object_store import ObjectStoreSync

    model_dir = build_model(preset, root / preset, seed=0)
    vocab = len(SPECIAL_TOKENS) + len(MODEL_PRESETS[preset].alphabet)
    probe = [1] + np.random.default_rng(123).integers(3, vocab, 31).tolist()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    learner = LearnerPool(model_dir, LearnerConfig(num_ranks=1, lr=1e-3, tokens_per_microbatch=4096), resolve_recipe("grpo"))
    rollout = RolloutPool(str(model_dir), RolloutConfig(num_workers=1, weight_load="in_place"), EnvConfig(), queue=None,
                          dtype="float32", max_model_len=128)  # fmt: skip
    rows, version = [], 0
    try:
        rollout.start()
        full = ObjectStoreSync(learner, rollout, WeightSyncConfig(transport="object_store", timeout_s=timeout_s), "streaming")
        delta = DeltaSync(learner, rollout, WeightSyncConfig(transport="object_store", delta=True, timeout_s=timeout_s), "streaming")
        plan = [("full", full, True)] * syncs + [("delta first (full)", delta, True)]
        plan += [("delta, all changed", delta, True)] * syncs + [("delta, none changed", delta, False)] * syncs
        for kind, sync, step in plan:
            if step:
                learner.train_step(_groups(vocab, version))
            version += 1
            began = time.perf_counter()
            result = sync.finish(sync.start(version))
            seconds = time.perf_counter() - began
            engine = np.asarray(rollout.score(probe, 8))
            parity = float(np.max(np.abs(engine - np.asarray(learner.score(probe, 8, RAW)))))
            rows.append({"preset": preset, "kind": kind, "seconds": seconds, "bytes": result.num_bytes, "parity_after": parity})
            print(f"{preset} {kind}: {seconds:.3f} s, {result.num_bytes / 1e6:.1f} MB, parity {parity:.1e}", flush=True)
        assert delta.resyncs == 0
    finally:
        rollout.shutdown()
        learner.shutdown()
        ray.shutdown()
    return rows


def _groups(vocab: int, seed: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weight_sync import synthetic_groups

    return synthetic_groups(vocab, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["w3-125m"])
    parser.add_argument("--fractions", nargs="+", type=float, default=FRACTIONS)
    parser.add_argument("--lrs", nargs="+", type=float, default=LRS)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    parser.add_argument("--parts", nargs="+", default=["wire", "steps", "export"], choices=["wire", "steps", "export", "e2e"])
    parser.add_argument("--e2e-syncs", type=int, default=3)
    parser.add_argument("--export-syncs", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES, help="engine dtypes of part wire")
    common.add_output_options(parser, "weight_sync_delta", "w3-0.5m, fractions 0 0.01 1, lr 1e-5")
    args = parser.parse_args()
    if args.quick:
        args.presets, args.fractions, args.lrs, args.export_syncs = ["w3-0.5m"], [0.0, 0.01, 1.0], [1e-5], 1
    common.set_runtime_env()
    load_start = common.load_average()
    import torch

    torch.set_num_threads(1)  # a learner rank and an engine each copy on one thread (W3's convention)
    results: dict = {"wire": [], "steps": [], "export": [], "e2e": []}
    with tempfile.TemporaryDirectory() as root:
        for preset in args.presets:
            if "export" in args.parts:
                results["export"] += export_rows(preset, Path(root), args.export_syncs)
            if "e2e" in args.parts:
                results["e2e"] += e2e_rows(preset, Path(root), args.e2e_syncs)
            if "wire" not in args.parts and "steps" not in args.parts:
                continue
            model, state = load_state(preset, Path(root))
            for dtype in args.dtypes if "wire" in args.parts else []:
                for fraction in args.fractions:
                    row = {"preset": preset, **wire_row(state, dtype, fraction, args.bucket_bytes)}
                    results["wire"].append(row)
                    print(f"{preset} {dtype} {fraction:>6}: bytes {row['bytes_ratio']:.3f} of full "
                          f"({row['delta_bytes'] / 1e6:.1f} MB), seconds {row['seconds_ratio']:.2f} of full "
                          f"(learner {row['delta_learner_s']:.2f}/{row['full_learner_s']:.2f} s, "
                          f"engine {row['delta_engine_s']:.2f}/{row['full_engine_s']:.2f} s)", flush=True)  # fmt: skip
            del state
            for row in step_rows(model, args.lrs) if "steps" in args.parts else []:
                results["steps"].append({"preset": preset, **row})
                print(f"{preset} AdamW lr {row['lr']:g} {row['dtype']}: {row['changed_fraction']:.4f} of the elements "
                      f"changed, delta {row['bytes_ratio']:.3f} of full", flush=True)  # fmt: skip
    results["machine"] = common.machine(load_start)
    common.write_json(common.output_path("weight_sync_delta", args), results)


if __name__ == "__main__":
    main()
