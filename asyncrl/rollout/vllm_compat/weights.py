"""Weights into a running vLLM engine (checked with vLLM 0.32.0, CPU and CUDA): the worker extension that loads
safetensors buckets, a shared-memory segment or a broadcast over a process group, in place or through vLLM's
reload, and the engine-side calls around a load (pause, load, label the version, resume).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncrl.rollout.vllm_compat.moe import repack_cpu_experts
from asyncrl.rollout.vllm_compat.process import on_cpu

if TYPE_CHECKING:
    import torch

STAGE_BUCKET_RPC = "asyncrl_stage_weight_bucket"
LOAD_STAGED_RPC = "asyncrl_load_staged_weights"
LOAD_SHARED_RPC = "asyncrl_load_shared_weights"
RECEIVE_COLLECTIVE_RPC = "asyncrl_receive_collective"
PREPARE_IN_PLACE_RPC = "asyncrl_prepare_in_place"
PROCESS_INFO_RPC = "asyncrl_process_info"
AUTO_IN_PLACE_MAX_HIDDEN = 256
"""`weight_load: auto` loads in place up to this hidden size: unpacked `F.linear` decoded 7% faster than vLLM's
oneDNN-packed kernels at hidden 96 and 32% slower at hidden 512 (benchmarks/weight_sync.py, decode_s)."""


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

    if TYPE_CHECKING:  # what vLLM's worker, which this class is mixed into, provides
        device: torch.device
        model_runner: Any
        vllm_config: Any

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
        from asyncrl.weights.delta import HEADER

        buckets, self._asyncrl_staged = getattr(self, "_asyncrl_staged", []), []
        first = unpack_bucket(buckets[0]) if buckets else {}
        if HEADER in first:
            return self._asyncrl_load_delta(first, buckets[1:], in_place)
        self._asyncrl_forget_delta()
        names: list[str] = []

        def named_tensors():  # one bucket deserialized at a time (the first one already is)
            for i, data in enumerate(buckets):
                for name, tensor in (first if i == 0 else unpack_bucket(data)).items():
                    names.append(name)
                    yield name, tensor

        self._asyncrl_load(named_tensors(), in_place)
        return len(names)

    def _asyncrl_load_delta(self, first: dict[str, Any], rest: list[bytes], in_place: bool) -> int:
        """Apply a `weights.delta` payload (full or delta) to this worker's copy of the weights it serves and load
        the result: in place only the tensors that changed, else (vLLM's reload sees the whole model) every one.
        A delta this copy cannot take raises with `BASE_MISMATCH` before anything is loaded (the transport then
        sends the full version)."""
        from asyncrl.weights.buckets import unpack_bucket
        from asyncrl.weights.delta import DeltaMirror

        payload = dict(first)
        for data in rest:
            payload.update(unpack_bucket(data))
        if not hasattr(self, "_asyncrl_mirror"):
            self._asyncrl_mirror = DeltaMirror()
        header, changed = self._asyncrl_mirror.apply(payload)
        state = self._asyncrl_mirror.state
        model = self.model_runner.get_model()
        if in_place and _unpack_linear_layers(model):
            # Expert tensors all go again: `repack_cpu_experts` re-packs every expert of a layer after the load.
            wanted = set(changed)
            names = [n for n in state if n in wanted or EXPERTS in n]
            named = _without_retied_head(
                model, ((n, state[n]) for n in names), self.vllm_config.model_config.hf_text_config
            )
            _load_in_place(model, named, every_parameter=header.kind == "full")
            repack_cpu_experts(model)
        else:
            self._asyncrl_load(iter(list(state.items())), in_place=False)
        return len(changed)

    def _asyncrl_forget_delta(self) -> None:
        """Weights that came another way: the delta copy no longer holds what the model serves, so the next delta
        is refused (and the full version sent) rather than loaded over weights it does not describe."""
        if hasattr(self, "_asyncrl_mirror"):
            del self._asyncrl_mirror

    def asyncrl_load_shared_weights(self, wire: str, in_place: bool = False) -> int:
        """Load a version from the shared-memory segment (`SharedWeights.to_wire()`): the model reads views of
        the mapped file, so nothing is deserialized; the file stays mapped for the next versions."""
        from asyncrl.weights.segment import SegmentReader, SharedWeights

        shared = SharedWeights.from_wire(wire)
        self._asyncrl_forget_delta()
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
        self._asyncrl_forget_delta()
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
        loader: Any = get_model_loader(self.vllm_config.load_config)  # the default loader: `get_all_weights`
        checkpoint = loader.get_all_weights(self.vllm_config.model_config, model)
        _load_in_place(model, _without_retied_head(model, checkpoint, self.vllm_config.model_config.hf_text_config))
        repack_cpu_experts(model)
        return True

    def _asyncrl_load(self, named: Iterator[tuple[str, Any]], in_place: bool) -> None:
        model = self.model_runner.get_model()
        named = _without_retied_head(model, named, self.vllm_config.model_config.hf_text_config)
        if in_place and _unpack_linear_layers(model):
            _load_in_place(model, named)
        else:
            self.model_runner.reload_weights(weights_iterator=named)
        repack_cpu_experts(model)


TIED_HEAD = "lm_head.weight"
EXPERTS = ".experts."
"""In the checkpoint name of every MoE expert tensor (`model.layers.<i>.mlp.experts.<e>.gate_proj.weight`)."""
TIED_EMBEDDING = "model.embed_tokens.weight"


def _without_retied_head(model: Any, named: Iterator[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """`named` without the tied head for a model that has no `lm_head` module and computes its logits from the
    embedding (vLLM's Gemma 2): the learner sends `lm_head.weight` for every tied model (weights/buckets.py),
    which such a model's loader rejects. Only a tied model's head is left out, and only when it equals the
    embedding that travels with it; anything else goes to the model's loader, which names what it lacks."""
    if not getattr(config, "tie_word_embeddings", False) or hasattr(model, "lm_head"):
        yield from named
        return
    head = embedding = None
    for name, tensor in named:
        if name == TIED_HEAD:
            head = tensor
            continue
        if name == TIED_EMBEDDING:
            embedding = tensor
        yield name, tensor
    if head is not None and embedding is not None and not _same_tensor(head, embedding):
        raise ValueError(
            f"{TIED_HEAD} differs from {TIED_EMBEDDING} in a tied model that computes logits from the embedding"
        )


def _same_tensor(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _load_in_place(model: Any, named: Iterator[tuple[str, Any]], every_parameter: bool = True) -> None:
    """Copy checkpoint-named tensors into the parameters (`_unpack_linear_layers` done); raise naming the
    parameters that no tensor reached, rather than serve a half-updated model (`every_parameter`; a delta
    names only the tensors that changed)."""
    loaded = model.load_weights(named)
    if not every_parameter:
        return
    missing = {name for name, _ in model.named_parameters()} - set(loaded or ())
    if missing:
        raise RuntimeError(f"in-place weight load left {len(missing)} parameters unchanged, e.g. {sorted(missing)[:3]}")


def _unpack_linear_layers(model: Any) -> bool:
    """Make `model` loadable in place (`WeightReceiver`): every CPU linear layer whose weight vLLM packed away
    gets its model-format parameter back (vLLM's own reload metadata, weight loaders unwrapped) and runs
    `torch.nn.functional.linear` on it (`_plain_linear`). Idempotent. False (nothing changed) off CPU or when a
    layer is not an unquantized linear/embedding, whose weights need vLLM's processing after every load."""
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


async def prepare_in_place(llm: Any, auto: bool) -> bool:
    """Give every worker of `llm` the kernels in-place loads need, before it serves (`WeightReceiver`); False
    when the engine will reload instead (`auto`: decided by the model's width)."""
    return all(await llm.collective_rpc(PREPARE_IN_PLACE_RPC, args=(auto,)))


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
