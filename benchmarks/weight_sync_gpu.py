"""W3 on a CUDA machine: the collective transport's wire over NCCL, and the CUDA IPC limit (benchmarks/README.md).

A GPU machine lent to a session has neither Ray nor vLLM, so this measures the wire alone: two processes, one as
learner rank 0 and one as an engine's vLLM worker, run the calls they make in a run. The sender builds a
Qwen2-shaped state on its device (the preset's parameter names and shapes, random values drawn from a seed per
version), stages it (`CollectiveSender.stage`) and sends it; the receiver takes it
(`CollectiveReceiver.receive`, as `vllm_compat.WeightReceiver.asyncrl_receive_collective` does) and copies
every tensor into its own parameter tensors, in place (vLLM's `load_weights` does that copy in a run).

Transports (`--transports`):
- `nccl`: the wire's NCCL branch as a run uses it, both ranks on GPU 0. NCCL refuses two ranks on one GPU
  ("Duplicate GPU detected"): on a one-GPU machine the row records that error.
- `nccl_hostid`: the same, with a different `NCCL_HOSTID` per process, so that NCCL takes the two ranks for two
  hosts and connects them through its socket transport on 127.0.0.1: the wire end to end on CUDA (group setup,
  header, digest, buckets), at the bandwidth of sockets through host memory, not that of NVLink.
- `ipc`: the receiver maps the sender's staging buffer once (a CUDA IPC handle; on CPU a shared-memory file,
  both through `torch.multiprocessing`) and copies from it in place: what a learner and an engine that share
  a GPU (or a node, on CPU) could reach; the limit the two transports above are compared with.
- `gloo`: the wire on CPU (`--device cpu`), so that this script runs, and is tested, without a GPU.

Per size and transport: the first sync (it sets up the group and the layout) and the median of the later ones,
timed from the start of the stage to the moment the receiver's parameters hold the version (CUDA
synchronized), each split into stage and load; bytes/s; `vs_copy`, a device copy of the same bytes (best of 5,
the same process, the same run) over the sync (1.0: a sync as fast as one copy of the weights; a sync copies at
least twice, stage and load); and `parity`, the largest |parameter - the value the seed gives| after each
sync (0 when every byte arrived).

    python benchmarks/weight_sync_gpu.py                   # CUDA: w3-0.5m .. qwen-0.5b fp32, qwen2-7b bf16
    python benchmarks/weight_sync_gpu.py --device cpu --quick     # the CPU wire (gloo, shared memory), seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = ["w3-0.5m", "w3-25m", "w3-125m", "qwen-0.5b", "qwen2-7b"]
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}  # fmt: skip
"""Qwen2-7B's shapes (7.6B parameters), synced in bf16 as a GPU run would; the asyncrl presets sync in fp32."""
BUCKET_BYTES = 64 << 20  # weight_sync.bucket_bytes' default
HOSTIDS = {"sender": "asyncrl-bench-sender", "receiver": "asyncrl-bench-receiver"}
SOCKETS_ON_LOOPBACK = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def shapes_of(size: str) -> tuple[list[tuple[str, tuple[int, ...]]], str]:
    """(parameter name, shape) in the model's order, and the dtype the size syncs in. Built on the meta device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.models import PRESETS, qwen2_config

    config, dtype = (Qwen2Config(**QWEN2_7B), "bfloat16") if size == "qwen2-7b" else (qwen2_config(PRESETS[size]), "float32")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()], dtype


def values(shapes, dtype: str, version: int, device):
    """(name, tensor) of version `version`, one at a time: the same values on both sides, from one generator
    seeded by the version."""
    import torch

    gen = torch.Generator(device=device).manual_seed(version)
    for name, shape in shapes:
        yield name, torch.randn(shape, generator=gen, device=device).to(getattr(torch, dtype))


def state_for(shapes, dtype: str, version: int, device):
    return dict(values(shapes, dtype, version, device))


def parity_error(params, shapes, dtype: str, version: int, device) -> float:
    """max |parameter - its value in `version`|, one tensor at a time (a 7B state twice would not fit beside)."""
    return max(float((params[name].float() - expected.float()).abs().max()) for name, expected in values(shapes, dtype, version, device))


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_seconds(num_bytes: int, device, repeats: int = 5) -> float:
    """One device copy of `num_bytes` into a preallocated buffer (best of `repeats`)."""
    import torch

    src, dst, best = torch.ones(num_bytes, dtype=torch.uint8, device=device), torch.empty(num_bytes, dtype=torch.uint8, device=device), float("inf")
    for _ in range(repeats + 1):
        synchronize(device)
        began = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return best


def setup_process(role: str, transport: str, device_name: str):
    import torch

    if transport == "nccl_hostid":
        os.environ.update(SOCKETS_ON_LOOPBACK, NCCL_HOSTID=HOSTIDS[role])
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one core each, as the learner rank and the engine have on 2 CPUs
    return device


class WireSender:
    """Learner rank 0 on the collective wire: stage, hand the engine the record, send."""

    def __init__(self, size: str, device, to_receiver):
        from asyncrl.weights.group import CollectiveSender

        self.key, self.device, self.to_receiver = f"bench-{size}", device, to_receiver
        self.sender = CollectiveSender("127.0.0.1", device, BUCKET_BYTES, timeout_s=120.0)

    def sync(self, size: str, state, version: int) -> float:
        """-> when the stage was done; returns once the send is."""
        wire = self.sender.stage(state, version).to_wire(self.key)
        synchronize(self.device)
        staged = time.perf_counter()
        self.to_receiver.put(("pull", size, version, wire))
        self.sender.send(self.key)
        return staged


class IpcSender:
    """Learner rank 0 sharing one staging buffer with the engine: mapped by the engine once, rewritten per version."""

    def __init__(self, size: str, device, to_receiver):
        self.device, self.to_receiver, self.views = device, to_receiver, None

    def sync(self, size: str, state, version: int) -> float:
        import torch

        from asyncrl.weights.segment import SegmentLayout

        if self.views is None:
            layout = SegmentLayout.of(state)
            staging = torch.zeros(layout.size, dtype=torch.uint8, device=self.device)
            staging = staging if self.device.type == "cuda" else staging.share_memory_()
            self.views = layout.views(staging)
            self.to_receiver.put(("map", size, 0, (staging, layout.to_json())))
        for name, tensor in state.items():
            self.views[name].copy_(tensor)
        synchronize(self.device)  # another process reads it: this stream's order does not reach it
        staged = time.perf_counter()
        self.to_receiver.put(("load", size, version, None))
        return staged


def sender_main(transport: str, device_name: str, sizes: list[str], versions: int, to_receiver, replies, results) -> None:
    """Learner rank 0: per size, stage and send `versions` versions, waiting for each acknowledgement."""
    import torch

    try:
        device = setup_process("sender", transport, device_name)
        for size in sizes:
            shapes, dtype = shapes_of(size)
            sender, rows = (IpcSender if transport == "ipc" else WireSender)(size, device, to_receiver), []
            to_receiver.put(("prepare", size, 0, None))  # the engine's parameters, allocated before any timing
            replies.get(timeout=600)
            for version in range(1, versions + 1):
                state = state_for(shapes, dtype, version, device)
                synchronize(device)
                began = time.perf_counter()
                staged = sender.sync(size, state, version)
                done, parity = replies.get(timeout=600)
                rows.append({"version": version, "stage_s": staged - began, "load_s": done - staged, "total_s": done - began, "parity": parity})
                del state
            num_bytes = layout_bytes(shapes, dtype)
            results.put(("size", size, {"dtype": dtype, "bytes": num_bytes, "copy_s": copy_seconds(num_bytes, device), "syncs": rows}))
            del sender
            if device.type == "cuda":
                torch.cuda.empty_cache()
        to_receiver.put(("stop", None, None, None))
    except BaseException as e:  # the parent records it, and stops the receiver
        results.put(("error", "sender", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


def layout_bytes(shapes, dtype: str) -> int:
    import math

    import torch

    return sum(math.prod(shape) for _, shape in shapes) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def receiver_main(transport: str, device_name: str, to_receiver, replies, results) -> None:
    """An engine's worker: take each version, copy it into its parameters, check it, acknowledge it."""
    import torch

    from asyncrl.weights.group import CollectiveReceiver
    from asyncrl.weights.segment import SegmentLayout

    try:
        device = setup_process("receiver", transport, device_name)
        current, params, receiver, views = None, None, None, None
        while True:
            kind, size, version, payload = to_receiver.get(timeout=900)
            if kind == "stop":
                return
            if size != current:
                params = receiver = views = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                shapes, dtype = shapes_of(size)
                params = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for name, shape in shapes}
                current, receiver = size, (CollectiveReceiver(device) if transport != "ipc" else None)
            if kind == "prepare":
                replies.put((time.perf_counter(), 0.0))
                continue
            if kind == "map":
                staging, layout = payload
                views = SegmentLayout.from_json(layout).views(staging)
                continue
            named = receiver.receive(payload)[1] if kind == "pull" else views.items()
            for name, view in named:
                params[name].copy_(view)
            synchronize(device)
            done = time.perf_counter()
            replies.put((done, parity_error(params, shapes, dtype, version, device)))
    except BaseException as e:
        results.put(("error", "receiver", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


def run_transport(transport: str, device_name: str, sizes: list[str], versions: int, timeout_s: float) -> list[dict]:
    """One sender and one receiver process (spawned) through every size; a failure ends the transport with a row
    that names the size, the side and the error, and both processes are stopped."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_receiver, replies, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=sender_main, args=(transport, device_name, sizes, versions, to_receiver, replies, results), name="sender"),
        ctx.Process(target=receiver_main, args=(transport, device_name, to_receiver, replies, results), name="receiver"),
    ]  # fmt: skip
    for p in procs:
        p.start()
    rows, left, error, deadline = [], list(sizes), None, time.monotonic() + timeout_s
    while left and error is None:
        try:
            kind, who, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            error = f"no result within {timeout_s:.0f} s"
            break
        if kind == "error":
            error = f"{who}: {payload}"
        else:
            rows.append(summarise(transport, who, payload))
            left.remove(who)
            print(format_row(rows[-1]), flush=True)
    for p in procs:
        p.join(timeout=60 if error is None else 5)
        if p.is_alive():
            p.kill()
    if error is not None:
        rows.append({"transport": transport, "size": left[0], "error": error})
        print(f"  {transport} {left[0]}: {error.splitlines()[0]}", flush=True)
    return rows


def summarise(transport: str, size: str, measured: dict) -> dict:
    """The first sync (group and layout set up) apart; the later ones as medians."""
    first, later = measured["syncs"][0], measured["syncs"][1:] or measured["syncs"]
    total = statistics.median(s["total_s"] for s in later)
    return {
        "transport": transport, "size": size, "dtype": measured["dtype"], "bytes": measured["bytes"],
        "first_total_s": first["total_s"], "total_s": total,
        "stage_s": statistics.median(s["stage_s"] for s in later), "load_s": statistics.median(s["load_s"] for s in later),
        "bytes_per_s": measured["bytes"] / total, "copy_s": measured["copy_s"], "vs_copy": measured["copy_s"] / total,
        "parity": max(s["parity"] for s in measured["syncs"]), "syncs": measured["syncs"],
    }  # fmt: skip


def format_row(r: dict) -> str:
    return (f"  {r['transport']:<12} {r['size']:<10} {r['dtype']:<9} {r['bytes'] / 1e6:>9.1f} MB  first {r['first_total_s']:8.4f} s  "
            f"sync {r['total_s']:8.4f} s (stage {r['stage_s']:.4f} + load {r['load_s']:.4f})  {r['bytes_per_s'] / 1e9:7.2f} GB/s  "
            f"vs copy {r['vs_copy']:.3f}  parity {r['parity']:.1e}")  # fmt: skip


def device_label(device_name: str) -> dict:
    import torch

    label = {"device": device_name, "torch": torch.__version__}
    if device_name.startswith("cuda"):
        label |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return label


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=None, choices=SIZES)
    parser.add_argument("--transports", nargs="+", default=None, choices=["nccl", "nccl_hostid", "ipc", "gloo"])
    parser.add_argument("--versions", type=int, default=4, help="syncs per size and transport (the first sets up)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per transport: the sizes left are reported as not reached")
    common.add_output_options(parser, "weight_sync_gpu", "w3-0.5m and w3-25m, 3 versions")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    sizes = args.sizes or (["w3-0.5m", "w3-25m"] if args.quick else SIZES if on_cuda else SIZES[:3])
    transports = args.transports or (["nccl", "nccl_hostid", "ipc"] if on_cuda else ["gloo", "ipc"])
    versions = 3 if args.quick else args.versions
    load_start = common.load_average()
    print(f"weight sync wire on {args.device}: {', '.join(transports)} x {', '.join(sizes)}, {versions} versions each", flush=True)
    rows = [row for t in transports for row in run_transport(t, args.device, sizes, versions, args.timeout_s)]
    name = "weight_sync_gpu" if on_cuda else "weight_sync_gpu_cpu"
    out = common.output_path(name, args)
    label = {**common.machine(load_start), **device_label(args.device), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    common.write_json(out, {"machine": label, "bucket_bytes": BUCKET_BYTES, "versions": versions, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
