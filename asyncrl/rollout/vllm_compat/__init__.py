"""Every vLLM-specific workaround of asyncrl, in one place (written against vLLM 0.32.0, CPU and CUDA).

Each item names the vLLM version it was checked with. When vLLM is upgraded, this is the only package whose
assumptions need re-checking; `engine.py` talks to vLLM through the public `AsyncLLM` API plus what is here,
by role: `process` (the engine's process), `weights` (loading weights into it), `outputs` (requests in, tokens
and log-probs out), `errors` (vLLM's own error of an engine that died at start), `limits` (what the CPU build
serves, read from `config.json` for `asyncrl check`). Every name below is importable from here.

Contents:
- `mark_output` / `start_failure_cause`: vLLM's own error when the engine dies at start (it says "see above").
- `cpu_head_size_problem` / `cpu_dtypes`: the head sizes and dtypes vLLM's CPU build serves.
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
- `repack_cpu_experts`: the CPU build's MoE expert weights packed again after a weight load (`moe`).
- `load_adapter` / `lora_request`: the policy's LoRA adapter (`learner.lora`) loaded in place and named by requests.
- `routed_experts` / `routes_problem`: the experts vLLM routed each token to, and why these engines cannot return
  them (`routes`).
"""

from asyncrl.rollout.vllm_compat.adapter import load_adapter, lora_request
from asyncrl.rollout.vllm_compat.errors import (
    EngineStartError,
    mark_output,
    start_failure_cause,
    start_failures_explained,
)
from asyncrl.rollout.vllm_compat.limits import CPU_ATTENTION_HEAD_SIZES, cpu_dtypes, cpu_head_size_problem
from asyncrl.rollout.vllm_compat.moe import repack_cpu_experts
from asyncrl.rollout.vllm_compat.outputs import (
    child_request_id,
    sampled_logprobs,
    token_input,
    top_logprobs,
    version_per_token,
)
from asyncrl.rollout.vllm_compat.process import (
    ENGINE_CORE_PRELOAD,
    WEIGHT_RECEIVER_QUALNAME,
    configure_process_env,
    cpu_build,
    create_async_llm,
    engine_args,
    freeze_startup_heap,
    on_cpu,
    start_engine_core_server,
    unfreeze_heap,
)
from asyncrl.rollout.vllm_compat.routes import routed_experts, routes_problem
from asyncrl.rollout.vllm_compat.weights import (
    AUTO_IN_PLACE_MAX_HIDDEN,
    LOAD_SHARED_RPC,
    LOAD_STAGED_RPC,
    PREPARE_IN_PLACE_RPC,
    PROCESS_INFO_RPC,
    RECEIVE_COLLECTIVE_RPC,
    STAGE_BUCKET_RPC,
    WeightReceiver,
    load_weights,
    pause_for_update,
    prepare_in_place,
    resume_after_update,
    set_weight_version,
)

__all__ = [
    "EngineStartError",
    "AUTO_IN_PLACE_MAX_HIDDEN",
    "CPU_ATTENTION_HEAD_SIZES",
    "ENGINE_CORE_PRELOAD",
    "LOAD_SHARED_RPC",
    "LOAD_STAGED_RPC",
    "PREPARE_IN_PLACE_RPC",
    "PROCESS_INFO_RPC",
    "RECEIVE_COLLECTIVE_RPC",
    "STAGE_BUCKET_RPC",
    "WEIGHT_RECEIVER_QUALNAME",
    "WeightReceiver",
    "child_request_id",
    "configure_process_env",
    "cpu_build",
    "cpu_dtypes",
    "cpu_head_size_problem",
    "create_async_llm",
    "engine_args",
    "start_failures_explained",
    "freeze_startup_heap",
    "load_adapter",
    "load_weights",
    "lora_request",
    "mark_output",
    "on_cpu",
    "pause_for_update",
    "prepare_in_place",
    "repack_cpu_experts",
    "resume_after_update",
    "routed_experts",
    "routes_problem",
    "sampled_logprobs",
    "set_weight_version",
    "start_engine_core_server",
    "start_failure_cause",
    "token_input",
    "top_logprobs",
    "unfreeze_heap",
    "version_per_token",
]
