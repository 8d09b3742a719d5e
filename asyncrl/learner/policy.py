"""The learner's modules: the policy (a Hugging Face causal LM whose forward returns token log-probs) and
the optional critic (the same trunk plus a scalar value head), and how both are sharded with FSDP2.

Log-prob semantics (architecture invariant 4): the learner scores the distribution the engine sampled
from: logits divided by the sampling temperature, then vLLM's top-k and top-p (`asyncrl.algo.sampling`).
The LM head and the log-softmax run in FP32 whatever the parameter dtype (ScaleRL's FP32 head); with fp32
weights this matches a plain transformers forward to ~1e-7.

Gradient reduction (architecture invariant 5): FSDP2 in torch 2.13 AVERAGES gradients over the
data-parallel ranks by default (`ReduceOp.AVG`, or SUM followed by a division by the world size when
sum-only collectives are forced; see `_get_gradient_divide_factors` in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Our per-token weights already divide by the
whole batch's denominators, so the batch gradient is the SUM of the ranks' gradients. Instead of
multiplying every rank's loss by dp_size and letting FSDP divide again, `shard` sets the divide factor
to 1 with sum-only collectives on every FSDP unit: gradients are summed, the loss is not rescaled, and
no multiply/divide rounding enters (exact for any dp_size, not only powers of two).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.algo.sampling import SamplingDistribution, token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from asyncrl.learner.packing import PackedLayout

__all__ = [
    "HF_PREFIX",
    "PolicyModel",
    "ValueModel",
    "cast_layers",
    "checkpoint_layers",
    "compile_layers",
    "decoder_stack",
    "final_logits",
    "hf_name",
    "load_causal_lm",
    "shard",
    "uses_fsdp",
]

# Parameter names inside PolicyModel are the Hugging Face names behind this prefix.
HF_PREFIX = "causal_lm."


def hf_name(name: str) -> str:
    """`causal_lm.model.layers.0...` -> `model.layers.0...` (the Hugging Face checkpoint name)."""
    return name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name


def load_causal_lm(model_dir: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The checkpoint in `model_dir` as a transformers causal LM. A model that soft-caps its attention scores
    (Gemma 2's `attn_logit_softcapping`) gets transformers' `eager` attention: its SDPA path drops the cap,
    which vLLM applies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype, **({"attn_implementation": "eager"} if eager else {})
    )
    model.config.use_cache = False
    return model


def decoder_stack(causal_lm: PreTrainedModel) -> tuple[PreTrainedModel, nn.ModuleList]:
    """(the decoder model under the LM head, e.g. `Qwen2Model`; its blocks), found through transformers'
    `get_decoder()`; a ValueError naming the architecture when the model has no such stack."""
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, nn.ModuleList):
        architecture = type(causal_lm).__name__
        raise ValueError(
            f"{architecture}: the learner needs a decoder stack (`get_decoder().layers`, a ModuleList of blocks); "
            "this architecture has none (supported families: docs/models.md)"
        )
    return decoder, layers


_UNHANDLED_HEAD_SCALES = ("logit_scale", "logits_scaling")
"""Config fields of architectures that scale their logits (Cohere, Granite), which `final_logits` does not apply."""


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the model's own forward does to `lm_head(hidden)`: Gemma 2's (and 3's) soft-capping,
    `cap * tanh(logits / cap)` with `final_logit_softcapping`; the identity for the other families."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _check_head(causal_lm: PreTrainedModel) -> None:
    scaled = [f for f in _UNHANDLED_HEAD_SCALES if getattr(causal_lm.config, f, None) not in (None, 1, 1.0)]
    if scaled:
        raise ValueError(f"{type(causal_lm).__name__}: the learner does not apply the logit scaling {scaled}")


def _shifted_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, sampling: SamplingDistribution) -> torch.Tensor:
    """log p(input_ids[:, t+1]) under the processed distribution from logits at t, [B, L]; the last column
    (predicts nothing) is 0."""
    return F.pad(token_logprobs(logits[:, :-1], input_ids[:, 1:], sampling), (0, 1))


class PolicyModel(nn.Module):
    """Wraps a causal LM so that the FSDP root is this module and its forward is the learner's log-prob
    recompute. (Calling the inner `model.model` directly would bypass the root's FSDP hooks.)"""

    def __init__(self, causal_lm: PreTrainedModel):
        super().__init__()
        decoder_stack(causal_lm)
        _check_head(causal_lm)
        self.causal_lm = causal_lm

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return decoder_stack(self.causal_lm)[1]

    @property
    def transformer(self) -> PreTrainedModel:
        """The Hugging Face model whose attention implementation `shard` may switch."""
        return self.causal_lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: SamplingDistribution,
        layout: PackedLayout | None = None,
    ) -> torch.Tensor:
        """input_ids, attention_mask, position_ids: [B, L] -> learner log-probs [B, L] (fp32) under the
        processed `sampling` distribution, aligned so column t scores token t+1 (batch.py); -inf for a
        token outside the kept set; padding columns hold garbage (possibly -inf). With a `layout` the forward
        runs on its packed bins instead (the rows' tensors are not read) and padding columns hold 0."""
        decoder = decoder_stack(self.causal_lm)[0]
        head = self.causal_lm.get_output_embeddings().weight
        if layout is not None:
            hidden = _packed_hidden(decoder, layout)[layout.query_slot]
            logits = final_logits(self.causal_lm.config, F.linear(hidden.float(), head.float()))
            return layout.scatter_queries(token_logprobs(logits, layout.query_target, sampling))
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        logits = final_logits(self.causal_lm.config, F.linear(hidden.float(), head.float()))
        return _shifted_logprobs(logits, input_ids, sampling)


def _packed_hidden(decoder: PreTrainedModel, layout: PackedLayout) -> torch.Tensor:
    """The decoder's last hidden states of `layout`'s slots, flat: [N * C, hidden]."""
    dtype: torch.dtype = decoder.get_input_embeddings().weight.dtype  # type: ignore[assignment]
    hidden = decoder(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask(decoder.config, dtype),
        position_ids=layout.position_ids,
        use_cache=False,
    ).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


class ValueModel(nn.Module):
    """The critic: the policy's trunk (a copy, trained separately) and a linear value head on the final
    hidden state, in fp32. Column t holds V(s[:t+1]), aligned with the loss mask (batch.py)."""

    def __init__(self, causal_lm: PreTrainedModel, seed: int = 0):
        super().__init__()
        self.trunk: PreTrainedModel = decoder_stack(causal_lm)[0]  # e.g. `Qwen2Model`
        hidden_size = causal_lm.config.hidden_size
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Same init on every rank (fully_shard keeps each rank's slice of its local tensor).
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, hidden_size**-0.5 * 0.1, generator=generator)
            self.value_head.bias.zero_()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return cast(nn.ModuleList, self.trunk.layers)  # a Hugging Face decoder stack's blocks

    @property
    def transformer(self) -> PreTrainedModel:
        return self.trunk

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        layout: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Values [B, L] of the rows, or (with a `layout`) of its packed bins gathered into the rows (0 on padding)."""
        if layout is not None:
            return layout.gather(self.value_head(_packed_hidden(self.trunk, layout).float()).squeeze(-1))
        hidden = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden.float()).squeeze(-1)


def uses_fsdp(num_ranks: int, fsdp: str = "auto") -> bool:
    """Whether `shard` wraps the modules with FSDP2 (`learner.fsdp`): `auto` with several ranks (one rank has
    nothing to shard), `always` on any number, `never` on one rank only (several ranks must shard)."""
    if fsdp not in ("auto", "always", "never"):
        raise ValueError(f"learner.fsdp must be auto, always or never (got {fsdp!r})")
    if fsdp == "never" and num_ranks > 1:
        raise ValueError(f"learner.fsdp = 'never' needs one rank; {num_ranks} ranks shard the model with FSDP2")
    return fsdp == "always" or (fsdp == "auto" and num_ranks > 1)


def shard(
    module: PolicyModel | ValueModel, mesh, compute_dtype: torch.dtype = torch.float32, fsdp: str = "auto"
) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, head). Gradients are
    SUMMED across ranks (module docstring).

    Mixed precision (`compute_dtype` bfloat16): the parameters stay fp32 (the master weights the optimizer
    steps, so an update below bf16 resolution still accumulates); the decoder layers all-gather and compute
    in bf16 and reduce their gradients in fp32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).
    The root keeps fp32: embeddings, final norm and the head (tied to the embeddings in small Qwen2 models)
    compute in fp32, so the logits and log-softmax see fp32 weights (ScaleRL's FP32 head).

    Whether to wrap is `uses_fsdp(mesh.size(), fsdp)` (`learner.fsdp`). One rank has nothing to shard, gather or
    reduce: under `auto` the module stays a plain one, and in bf16 its decoder layers get the same casts from two
    hooks (`cast_layers`); `always` wraps it all the same (FSDP2's own policy and DTensor state on one device).
    FSDP2's hooks and DTensor dispatch cost 5-12% of a W1-sized learner step on one CPU thread (wrapped against
    plain, fp32 and bf16: `benchmarks/fsdp_rank.py`, benchmarks/RESULTS.md). Every caller handles both kinds of
    tensor (`torch.distributed.checkpoint` reshards a one-rank checkpoint into any number of ranks and back, wrapped
    or not).

    bf16 on CPU: attention runs as plain matmuls and a softmax (transformers' `eager`) instead of SDPA, whose CPU
    kernel for bf16 is flash attention with a slow backward on short rows (torch 2.13: 60 ms of a W1 layer's
    backward, half of the step). A W1 step with `model.dtype=bfloat16`: 0.80 s with SDPA, 0.42-0.54 s
    eager, 0.54-0.66 s in fp32 (docs/algorithms.md#mixed-precision)."""
    mixed = compute_dtype != torch.float32
    if mixed and mesh.device_type == "cpu":
        module.transformer.set_attn_implementation("eager")  # the docstring's last paragraph
    if uses_fsdp(mesh.size(), fsdp):
        _fully_shard(module, mesh, compute_dtype)
    elif mixed:
        cast_layers(module, compute_dtype)


def _fully_shard(module: PolicyModel | ValueModel, mesh, compute_dtype: torch.dtype) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mixed = compute_dtype != torch.float32
    layers_policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    )
    for layer in module.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=layers_policy)
    fully_shard(module, mesh=mesh)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)


def cast_layers(module: PolicyModel | ValueModel, dtype: torch.dtype) -> None:
    """One rank's mixed precision without FSDP, with the numerics of FSDP2's `MixedPrecisionPolicy(param_dtype=
    dtype, reduce_dtype=fp32)` on one rank: while a decoder layer runs, each of its parameters is replaced by a
    `dtype` copy of the fp32 master (a differentiable cast, so the gradient reaches the master in fp32, as
    FSDP's fp32 reduction does) and the floating tensors it is called with are cast to `dtype`; the masters
    are put back when the layer returns or raises. The layer's output stays `dtype`, as under FSDP. Log-probs and
    gradients equal FSDP2's bit for bit; a W1 learner step in a run took 0.22-0.23 s against 0.30 s under FSDP2.
    Memory: the backward keeps each layer's `dtype` copies from the forward (2 bytes per parameter in bf16)
    where FSDP2 frees them and gathers again."""
    for layer in module.decoder_layers:
        slots = [(owner, name) for owner in layer.modules() for name, p in owner._parameters.items() if p is not None]
        layer.register_forward_pre_hook(functools.partial(_cast_in, slots=slots, dtype=dtype), with_kwargs=True)
        layer.register_forward_hook(_masters_back, always_call=True)


def _cast_in(layer: nn.Module, args: tuple, kwargs: dict, *, slots: list, dtype: torch.dtype) -> tuple:
    # Set in the instance dict, where `nn.Module.__setattr__` puts a list (its stub takes tensors and modules only).
    masters = layer.__dict__["_asyncrl_masters"] = [(owner, name, owner._parameters[name]) for owner, name in slots]
    for owner, name, master in masters:
        owner._parameters[name] = master.to(dtype)
    return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)


def _masters_back(layer: nn.Module, _args, _output) -> None:
    for owner, name, master in layer.__dict__.pop("_asyncrl_masters", ()):
        owner._parameters[name] = master


def _cast_floating(value, dtype: torch.dtype):
    """`value` with every floating tensor in it (through tuples, lists and dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def checkpoint_layers(module: PolicyModel | ValueModel) -> None:
    """`learner.activation_checkpointing`: every decoder layer keeps only its inputs for the backward, which runs
    the layer's call again to rebuild what its gradient needs (torch's non-reentrant checkpoint, as module hooks:
    `torch.distributed._composable.checkpoint`). The layers stay the same modules, so parameter names, checkpoints
    and exports are unchanged. Applied before `shard`: the recomputation repeats the whole call, hooks included, so
    `cast_layers`' hooks put the same `dtype` copies of the masters in place again (and the masters back after), and
    FSDP2's hooks, which see the backward's recomputation, leave the layer gathered by the backward as it is. On CPU
    log-probs, gradients and updates equal those without it bit for bit (tests/unit/learner/
    test_activation_checkpointing.py); on a GPU within CUDA's own run-to-run spread (benchmarks/RESULTS.md).
    `learner.compile` composes: the recomputation runs the compiled forward again."""
    from torch.distributed._composable import checkpoint

    for layer in module.decoder_layers:
        checkpoint(layer)


def compile_layers(module: PolicyModel | ValueModel) -> None:
    """`learner.compile`: `torch.compile` every decoder layer's forward, with dynamic shapes (one graph for every
    batch size and length), for the passes that build a graph; the passes without gradients (pi_old, the parity
    probe, scoring) run the layers as they are, so they compile nothing. The layers stay the same modules: their
    parameter names, optimizer, checkpoints and exports are unchanged."""
    for layer in module.decoder_layers:
        layer.forward = functools.partial(
            _compiled_when_training, torch.compile(layer.forward, dynamic=True), layer.forward
        )


def _compiled_when_training(compiled, eager, *args, **kwargs):
    return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
