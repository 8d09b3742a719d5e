"""Scale: a Qwen2.5-0.5B-shaped model through a real run on this CPU, with load, step and sync times and each
process's peak memory.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied
embeddings, rope theta 1e6), random init, fp32, with a production byte-level BPE vocabulary and a ChatML template
(`asyncrl.models.bpe.production_tokenizer`); it is built once with `save_pretrained` under
$TMPDIR/asyncrl-model-scale/ in a child process (so the build's memory is nobody's peak). The run is the real
thing: `Controller` with Ray, one vLLM CPU engine, two FSDP2 learner ranks over gloo, verl Parquet prompts (~32
prompt tokens, a rule reward), a weight sync and a parity probe after every step.

Reported: load time (the controller's start: replay queue, learner ranks loading the checkpoint, the engine
starting; and when the engines and the learner each were ready), per step the seconds between steps and the
learner's wait for a batch, per sync its seconds and bytes and the parity after it; per process (driver, each
learner rank, the rollout worker, the engine core, the rest: Ray's own processes and the replay queue) the peak
RSS (the kernel's high-water mark, VmHWM) and the peak PSS (shared pages split between their users: the figures
add up), sampled every 0.5 s, and the peak of all processes' PSS summed.

Weights reach the engine over the `collective` transport (gloo, in 64 MiB buckets from rank 0's staging buffer)
unless `--transport` says otherwise: `auto` picks shared memory on one node, whose two slots of the whole model
in /dev/shm (3.8 GB at this size) come on top of rank 0's gathered copy; on this 24 GB machine, shared with other
work, Ray's memory monitor killed that run at its first sync (benchmarks/notes/model_scale.md). The engine loads
in place (`--weight-load`; `auto` reloads at hidden 896, and vLLM's reload took the engine 2.2 GB up). Every process of the
run gets `MALLOC_MMAP_THRESHOLD_=131072` (`--mmap-threshold`, 0 for glibc's default): glibc then maps every
allocation of 128 KiB or more on its own and returns it on free, where by default the freed tensors of a learner
step stay in the heap (a rank rested at 4.6-5.7 GB after its steps instead of 3.2, and peaked at 7.1-7.9 GB
instead of 5.7; notes). A run that dies is written too, with its error and the peaks up to then; an option off its
default adds itself to the file name (`--dtype bfloat16` writes `model_scale_bfloat16.json`).

    python benchmarks/model_scale.py [--steps 3] [--transport collective] [--quick]     # ~7 min and ~21 GB on 2 cores (quick: ~1.5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common  # benchmarks/common.py: a script's own folder is on sys.path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


QWEN25_05B = Shape(896, 24, 14, 2, 4864)
"""Qwen2.5-0.5B's shape (its config.json); tied embeddings, rope theta 1e6."""
QUICK_SHAPE = Shape(128, 2, 2, 1, 512)
"""--quick: the same run on a small shape (the BPE embedding is most of it)."""
ROPE_THETA = 1e6


# ---------------------------------------------------------------------------------------------------
# The checkpoint and the prompts


def build_checkpoint(out: Path, shape: Shape, seed: int = 0) -> None:
    """A random-init Qwen2 of `shape` beside the production BPE tokenizer (ChatML), saved with save_pretrained."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.models.bpe import production_tokenizer

    tokenizer = production_tokenizer(chat_format="chatml")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


MODELS = Path(tempfile.gettempdir()) / "asyncrl-model-scale"
"""Where the checkpoints are kept between runs: outside asyncrl's cache (`asyncrl.models.cache_root`), so the run
reads the folder in place as it reads a user's `model.path` (a folder inside the cache is a preset, which the
driver packs into the object store for other nodes: `asyncrl.models.shipping`)."""


def ensure_checkpoint(shape: Shape) -> tuple[Path, float | None]:
    """(folder, build seconds or None when kept from an earlier run); built in a child process under a file lock."""
    from asyncrl.models import file_lock

    name = f"qwen2-h{shape.hidden}-l{shape.layers}-bpe-chatml"
    out = MODELS / name
    with file_lock(out.with_name(name + ".lock")):
        if (out / "config.json").exists():
            return out, None
        began = time.perf_counter()
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import model_scale as m; " \
               f"m.build_checkpoint(m.Path({str(out)!r}), m.{shape!r})"  # fmt: skip
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        return out, time.perf_counter() - began


def write_prompts(path: Path, n: int) -> None:
    """`n` verl rows asking for a sum, each ~32 tokens with the ChatML template; reward: the `add` rule."""
    from asyncrl.envs.data import write_verl_parquet

    rows = [
        {"data_source": "add",
         "prompt": [{"role": "system", "content": "You are a careful calculator."},
                    {"role": "user", "content": f"What is {17 * i % 89} plus {31 * i % 97}? Reply with the number only."}],
         "reward_model": {"style": "rule", "ground_truth": str(17 * i % 89 + 31 * i % 97)}, "extra_info": {"index": i}}
        for i in range(n)
    ]  # fmt: skip
    write_verl_parquet(rows, path)


# ---------------------------------------------------------------------------------------------------
# Memory per process


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _pss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class Seen:
    """One process's peaks as the sampler saw them (KiB)."""

    command: str
    hwm_kib: int = 0
    pss_kib: int = 0


@dataclass
class MemorySampler:
    """Samples the driver and every process under it (Ray's raylet and its workers, their children) every
    `period_s`: per pid the high-water RSS (VmHWM) and the peak PSS, and the peak of the PSS summed over all."""

    period_s: float = 0.5
    seen: dict[int, Seen] = field(default_factory=dict)
    total_pss_peak_kib: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="memory-sampler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            pid = proc.pid
            pss, hwm = _pss_kib(pid), _status_kib(pid, "VmHWM")
            if pss is None or hwm is None:
                continue  # gone meanwhile
            if pid not in self.seen:
                try:
                    self.seen[pid] = Seen(" ".join(proc.cmdline())[:120])
                except psutil.Error:
                    continue
            s = self.seen[pid]
            s.hwm_kib, s.pss_kib = max(s.hwm_kib, hwm), max(s.pss_kib, pss)
            try:  # Ray renames a worker once it hosts an actor
                s.command = " ".join(proc.cmdline())[:120] or s.command
            except psutil.Error:
                pass
            total += pss
        self.total_pss_peak_kib = max(self.total_pss_peak_kib, total)


def actor_pid(actor: Any) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def process_roles(controller: Any) -> dict[int, str]:
    """pid -> role of the run's processes: driver, each learner rank, the rollout worker and its engine core
    (vLLM's engine core forked, through a fork server, under the rollout worker)."""
    import psutil

    roles = {os.getpid(): "driver"}
    for rank, worker in enumerate(controller.fleet.learner.workers):
        roles[actor_pid(worker)] = f"learner rank {rank}"
    for name, worker in controller.fleet.rollout._workers.items():
        pid = actor_pid(worker)
        roles[pid] = f"rollout worker {name}"
        for child in psutil.Process(pid).children(recursive=True):
            roles[child.pid] = engine_role(" ".join(child.cmdline()))
    return roles


def engine_role(command: str) -> str:
    """The role of a process under the rollout worker, from its command line."""
    for marker, role in (("EngineCore", "engine core"), ("forkserver", "engine fork server"), ("resource_tracker", "engine resource tracker")):
        if marker in command:
            return role
    return f"engine child ({command[:40]})"


def memory_rows(sampler: MemorySampler, roles: dict[int, str]) -> list[dict[str, Any]]:
    """One row per role (peak RSS, peak PSS in GB), the processes without a role summed as `other`."""
    rows = [
        {"process": role, "pid": pid, "peak_rss_gb": sampler.seen[pid].hwm_kib / 2**20, "peak_pss_gb": sampler.seen[pid].pss_kib / 2**20}
        for pid, role in roles.items() if pid in sampler.seen
    ]  # fmt: skip
    others = [s for pid, s in sampler.seen.items() if pid not in roles]
    rows.append({"process": f"other ({len(others)} processes seen: Ray's own, the replay queue; peaks summed)", "pid": None,
                 "peak_rss_gb": sum(s.hwm_kib for s in others) / 2**20, "peak_pss_gb": sum(s.pss_kib for s in others) / 2**20})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------------
# The run


def run_config(tmp: Path, model_dir: Path, steps: int, transport: str, weight_load: str, dtype: str) -> Any:
    from asyncrl.config import load_config

    overrides = {
        "mode": "streaming", "output_dir": str(tmp / "run"), "model.path": str(model_dir),
        "data.task": "parquet", "data.train_path": str(tmp / "train.parquet"), "data.eval_prompts": 1,
        "rollout.num_workers": 1, "rollout.samples_per_prompt": 4, "rollout.max_tokens": 32, "rollout.max_model_len": 128, "rollout.weight_load": weight_load,
        "model.dtype": dtype, "learner.num_ranks": 2, "learner.tokens_per_microbatch": 256, "learner.prompts_per_step": 2, "learner.max_steps": steps,
        "buffer.max_staleness": 1, "buffer.filter_zero_variance": False,
        "weight_sync.transport": transport, "weight_sync.parity_probe_every": 1, "eval.every_steps": 0, "telemetry.progress": True, "telemetry.dashboard_port": 0, "checkpoint.export_hf": False,
    }  # fmt: skip
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def phase_times(run_dir: Path) -> dict[str, float]:
    """Phase text -> wall time (time.time()) from the run's events.jsonl."""
    times = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "phase":
            times[event["data"]["text"]] = event["data"]["time"]
    return times


def run(model_dir: Path, steps: int, transport: str, weight_load: str, dtype: str, tmp: Path) -> dict[str, Any]:
    from asyncrl.controller.loop import Controller

    write_prompts(tmp / "train.parquet", 64)
    cfg = run_config(tmp, model_dir, steps, transport, weight_load, dtype)
    sampler = MemorySampler()
    sampler.start()
    controller = Controller(cfg, model_dir)
    load_s, roles, error = None, {os.getpid(): "driver"}, None
    try:
        began, wall_began = time.perf_counter(), time.time()
        controller.start()
        load_s = time.perf_counter() - began
        roles = process_roles(controller)
        summary, error = controller.run(), None
    except Exception as e:  # noqa: BLE001 - a run that dies (e.g. out of memory) is a result: its peaks so far
        summary, error = None, f"{type(e).__name__}: {str(e)[:600]}"
    finally:
        try:
            controller.shutdown()
        except Exception as e:  # noqa: BLE001 - after a death the shutdown fails too; the first error is the one
            error = error or f"shutdown: {type(e).__name__}: {str(e)[:600]}"
        sampler.stop()
    phases = {text: t - wall_began for text, t in phase_times(Path(cfg.output_dir)).items()}
    return {"load_s": load_s, "phases_s": phases, "summary": summary, "error": error, "history": controller.records.history,
            "memory": memory_rows(sampler, roles), "total_pss_peak_gb": sampler.total_pss_peak_kib / 2**20}  # fmt: skip


def step_rows(history: list[dict[str, Any]], load_done_s: float) -> list[dict[str, Any]]:
    """Per step: seconds since the previous step ended (the first: since the loop began), the learner's wait for
    its batch, the sync's seconds and bytes, the parity after it."""
    rows, last = [], 0.0
    for row in history:
        rows.append({
            "step": row["step"], "step_s": row["wall_s"] - last, "learner_wait_s": row["learner_wait_s"],
            "sync_s": row.get("sync_s"), "sync_gb": (row.get("sync_bytes") or 0) / 1e9, "parity": row.get("parity_max_abs_diff"),
            "parity_probe_s": row.get("parity_probe_s"), "samples": row["samples"], "tokens": row["tokens"],
        })  # fmt: skip
        last = row["wall_s"] + (row.get("sync_s") or 0.0) + (row.get("parity_probe_s") or 0.0)
    return rows


def num_parameters(model_dir: Path) -> int:
    import math

    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def print_tables(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"\n{c['parameters'] / 1e6:.0f}M parameters (vocab {c['vocab_size']}), {c['steps']} steps, 2 learner ranks, 1 engine")
    print(f"load {result['load_s'] or float('nan'):.1f} s (engines ready {result['phases_s'].get('engines ready', float('nan')):.1f} s, "
          f"learner ready {result['phases_s'].get('learner ready', float('nan')):.1f} s); build "
          + ("cached" if result["build_s"] is None else f"{result['build_s']:.1f} s"))  # fmt: skip
    print(f"{'step':>4} {'step s':>8} {'wait s':>8} {'sync s':>8} {'sync GB':>8} {'parity':>9}")
    for s in result["steps"]:
        print(f"{s['step']:>4} {s['step_s']:>8.1f} {s['learner_wait_s']:>8.1f} {s['sync_s'] or 0:>8.2f} {s['sync_gb']:>8.2f} {_sci(s['parity']):>9}")
    print(f"\n{'process':<60} {'peak RSS GB':>12} {'peak PSS GB':>12}")
    for m in result["memory"]:
        print(f"{m['process']:<60} {m['peak_rss_gb']:>12.2f} {m['peak_pss_gb']:>12.2f}")
    print(f"{'all processes, PSS summed (peak)':<60} {'':>12} {result['total_pss_peak_gb']:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_options(parser, "model_scale", "a small shape with the same vocabulary, 2 steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--transport", default="collective", choices=["auto", "shared_memory", "collective", "object_store"],
                        help="weight_sync.transport (collective: see the module docstring)")
    parser.add_argument("--weight-load", default="in_place", choices=["auto", "in_place", "reload"],
                        help="rollout.weight_load (in_place: see the module docstring)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--mmap-threshold", type=int, default=128 << 10,
                        help="MALLOC_MMAP_THRESHOLD_ for every process of the run (0: glibc's default; see the module docstring)")
    args = parser.parse_args()
    common.set_runtime_env()
    import ray

    shape, steps = (QUICK_SHAPE, 2) if args.quick else (QWEN25_05B, args.steps)
    if args.mmap_threshold:  # glibc reads it at each process's start: Ray's processes inherit it from here
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    load_start = common.load_average()
    model_dir, build_s = ensure_checkpoint(shape)
    config = json.loads((model_dir / "config.json").read_text())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # 2 ranks + 1 rollout worker + spare
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-scale-") as tmp:
            measured = run(model_dir, steps, args.transport, args.weight_load, args.dtype, Path(tmp))
    finally:
        ray.shutdown()
    summary = measured.pop("summary") or {"final_version": None, "rollout": {}, "wall_clock_s": None}
    result = {
        "config": {"shape": vars(shape), "vocab_size": config["vocab_size"], "parameters": num_parameters(model_dir), "steps": steps,
                   "learner_ranks": 2, "engines": 1, "dtype": args.dtype, "tokens_per_microbatch": 256, "mmap_threshold": args.mmap_threshold, "prompts_per_step": 2, "samples_per_prompt": 4,
                   "max_tokens": 32, "transport": args.transport, "weight_load": args.weight_load, "model_dir": str(model_dir)},
        "build_s": build_s, "load_s": measured["load_s"], "phases_s": measured["phases_s"],
        "steps": step_rows(measured.pop("history"), measured["load_s"]), "memory": measured["memory"],
        "total_pss_peak_gb": measured["total_pss_peak_gb"], "final_version": summary["final_version"],
        "engine_versions": {name: e.get("version") for name, e in summary["rollout"].items()},
        "wall_clock_s": summary["wall_clock_s"], "machine": common.machine(load_start), "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/model_scale.py" + (" --quick" if args.quick else f" --steps {steps}") + f" --transport {args.transport} --weight-load {args.weight_load} --dtype {args.dtype} --mmap-threshold {args.mmap_threshold}",
        "error": measured["error"],
    }  # fmt: skip
    print_tables(result)
    variant = "".join(f"_{v}" for v, default in ((args.transport, "collective"), (args.weight_load, "in_place"), (args.dtype, "float32")) if v != default)
    variant += "" if args.mmap_threshold == 128 << 10 else f"_mmap{args.mmap_threshold}"
    common.write_json(common.output_path("model_scale" + variant, args), result)
    if measured["error"]:
        sys.exit(f"the run failed: {measured['error']}")


if __name__ == "__main__":
    main()
