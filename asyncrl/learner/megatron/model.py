"""The megatron backend's policy: a megatron-core `GPTModel` (local layer spec: torch modules, no Transformer Engine
or apex) built from a Hugging Face config, its weights loaded from and returned as Hugging Face tensors
(`convert.py`), tensor-parallel over megatron's TP group.

`MegatronPolicy` is called exactly like the FSDP2 backend's `PolicyModel` (`asyncrl.learner.policy`): input ids,
attention mask and position ids [B, L] -> learner log-probs [B, L] under the engines' processed sampling
distribution, the head and the log-softmax in fp32 (the decoder layers in bf16 with `model.dtype` bfloat16, as
FSDP2's), so `asyncrl.learner.step.RankStep` drives either.

Rows are right-padded with positions 0..n-1 (`asyncrl.learner.batch`), which megatron's rotary embedding assumes
(it numbers positions 0..L-1 itself); padding columns hold garbage, as in `PolicyModel`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.algo.sampling import SamplingDistribution
from asyncrl.learner.megatron import cpu
from asyncrl.learner.megatron.convert import converter_for, shard, unshard
from asyncrl.learner.policy import _shifted_logprobs, final_logits

if TYPE_CHECKING:
    from asyncrl.learner.packing import PackedLayout

__all__ = ["MegatronPolicy", "build_gpt", "init_parallel", "partition_dim", "transformer_config"]


def init_parallel(tensor_parallel: int, seed: int = 0) -> None:
    """megatron's process groups over the initialized default group: TP groups of `tensor_parallel` consecutive ranks,
    data parallel across them; the CPU shims (`cpu.apply`) where there is no CUDA, and with CUDA the RNG states its
    attention forks (`model_parallel_cuda_manual_seed`: the fork raises without them)."""
    from megatron.core import parallel_state

    cpu.apply()
    cpu.without_transformer_engine()
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def transformer_config(hf_config, tensor_parallel: int):
    """megatron's `TransformerConfig` for `hf_config` (fp32, no dropout, no fused CUDA kernels)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = converter_for(hf_config).config_fields(hf_config)
    if fields.get("num_moe_experts") and tensor_parallel > 1:
        raise ValueError(
            f"{hf_config.model_type}: an MoE model needs learner.tensor_parallel = 1 with the megatron backend "
            "(megatron splits MoE layers only with sequence parallelism, which the backend does not run)"
        )
    return TransformerConfig(
        **fields,
        activation_func=F.silu,
        tensor_model_parallel_size=tensor_parallel,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def padded_vocab(hf_config, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of `tensor_parallel` (megatron splits it evenly over the TP ranks)."""
    return -(-hf_config.vocab_size // tensor_parallel) * tensor_parallel


def build_gpt(hf_config, tensor_parallel: int):
    """A `GPTModel` of `hf_config`'s shape on this rank (its TP piece, uninitialized), with the Hugging Face model's
    own rotary frequencies (`_hf_inv_freq`: Llama 3's scaling included)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(hf_config, tensor_parallel)
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(hf_config, tensor_parallel),
        max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
    )
    gpt.rotary_pos_emb.inv_freq = _hf_inv_freq(hf_config)
    _mark_partitions(gpt)
    return gpt


def _mark_partitions(gpt) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` on every split parameter, which its layers set only
    when they initialize their weights themselves (`perform_initialization`; ours come from the checkpoint): the
    vocabulary and column-parallel layers split dim 0 (weight and bias), row-parallel layers their weight's dim 1."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for module in gpt.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            split = [("weight", 0), ("bias", 0)]
        elif isinstance(module, RowParallelLinear):
            split = [("weight", 1)]
        else:
            continue
        for name, dim in split:
            param = getattr(module, name, None)
            if isinstance(param, torch.Tensor):
                for attribute, value in (
                    ("tensor_model_parallel", True),
                    ("partition_dim", dim),
                    ("partition_stride", 1),
                ):
                    setattr(param, attribute, value)


def _hf_inv_freq(hf_config) -> torch.Tensor:
    """The inverse rotary frequencies transformers computes for `hf_config` (any `rope_type` without an attention
    scale); a ValueError for a scaled one (YaRN), which megatron's rotary embedding does not apply."""
    module = importlib.import_module(f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}")
    rotary_cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type))
    rotary = rotary_cls(hf_config)
    if float(rotary.attention_scaling) != 1.0:
        raise ValueError(
            f"{hf_config.model_type}: rope scaling with attention scale {rotary.attention_scaling} is not supported by "
            "learner.training_backend = megatron"
        )
    return rotary.inv_freq.detach().float().clone()


def partition_dim(param: torch.Tensor) -> int | None:
    """The dimension megatron splits `param` along over the TP ranks; None for a replicated one."""
    return int(getattr(param, "partition_dim", 0)) if getattr(param, "tensor_model_parallel", False) else None


class MegatronPolicy(nn.Module):
    """The policy on one rank: megatron's `GPTModel` (this rank's TP piece) behind `PolicyModel`'s call."""

    def __init__(self, gpt, hf_config, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gpt = gpt
        self.hf_config = hf_config
        self.converter = converter_for(hf_config)
        self._skeleton = None  # the meta-device transformers model `checkpoint_layout` needs (MoE), built once
        if compute_dtype != torch.float32:
            _mixed_precision(self, compute_dtype)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers (`asyncrl.learner.policy.cast_layers` puts their compute dtype in place)."""
        return self.gpt.decoder.layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: SamplingDistribution,
        layout: PackedLayout | None = None,
    ) -> torch.Tensor:
        if layout is not None:  # `RankStep.packs` is False for this policy: it trains padded rows only
            raise ValueError("the megatron policy takes padded rows, not a packed layout")
        _check_right_padded(attention_mask, position_ids)
        logits = self.gpt(input_ids, position_ids, attention_mask=_mask(attention_mask), runtime_gather_output=True)
        logits = final_logits(self.hf_config, logits[..., : self.hf_config.vocab_size].float())
        return _shifted_logprobs(logits, input_ids, sampling)

    # ------------------------------------------------------------------ Hugging Face weights in and out

    def load_hf_state(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's TP piece of every tensor of a full Hugging Face state dict (strict: every parameter set,
        no tensor left over)."""
        from megatron.core import parallel_state as ps

        full = self.converter.to_megatron(hf_state, self.hf_config)
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        params = dict(self.gpt.named_parameters())
        missing, unexpected = set(params) - set(full), set(full) - set(params)
        if missing or unexpected:
            raise KeyError(f"megatron load: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        with torch.no_grad():
            for name, param in params.items():
                piece = shard(name, self._padded(name, full[name], size), partition_dim(param), rank, size)
                if piece.shape != param.shape:
                    raise ValueError(f"megatron load: {name} piece {tuple(piece.shape)} != {tuple(param.shape)}")
                param.copy_(piece)

    def full_hf_state(self) -> dict[str, torch.Tensor]:
        """Every parameter joined over the TP ranks (one all-gather per split tensor, in the same order on every
        rank; collective over the TP group) under Hugging Face names, on the CPU."""
        return self._full_hf({name: param.detach() for name, param in self.gpt.named_parameters()})

    def full_hf_grads(self) -> dict[str, torch.Tensor]:
        """The batch gradient under Hugging Face names, on the CPU: every parameter's gradient summed over the
        data-parallel group and joined over the TP ranks (collective over both); a tied head's is the embedding's."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        grads = {}
        for name, param in self.gpt.named_parameters():
            grad = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
            if ps.get_data_parallel_world_size() > 1:
                dist.all_reduce(grad, group=ps.get_data_parallel_group())
            grads[name] = grad
        return self._full_hf(grads)

    def _full_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        params, full = dict(self.gpt.named_parameters()), {}
        for name, local in tensors.items():
            dim = partition_dim(params[name])
            if dim is not None and size > 1:
                pieces = [torch.empty_like(local) for _ in range(size)]
                torch.distributed.all_gather(pieces, local.contiguous(), group=group)
                local = unshard(name, pieces, dim)
            full[name] = self._unpadded(name, local).cpu()
        return self.converter.to_hf(full, self.hf_config)

    def checkpoint_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (Hugging Face in-memory names) in the checkpoint's layout engines load: an MoE layer's fused experts
        per expert (`asyncrl.learner.export.checkpoint_layout`, on a meta-device skeleton of the model); the same
        tensors for a dense family."""
        from asyncrl.learner.export import checkpoint_layout

        if getattr(self.hf_config, "num_experts", None) is None:
            return state
        if self._skeleton is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(self.hf_config)
        return checkpoint_layout(self._skeleton, state)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The step's gradient reduction and clip (`state.clip_grad_norm_`: DP sum, TP-aware norm); -> the norm."""
        from asyncrl.learner.megatron.state import clip_grad_norm_

        return clip_grad_norm_(self, max_norm)

    def _padded(self, name: str, tensor: torch.Tensor, size: int) -> torch.Tensor:
        if name not in _VOCAB_ROWS:
            return tensor
        rows = padded_vocab(self.hf_config, size) - tensor.shape[0]
        return F.pad(tensor, (0, 0, 0, rows)) if rows else tensor

    def _unpadded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[: self.hf_config.vocab_size] if name in _VOCAB_ROWS else tensor


def _mixed_precision(policy: MegatronPolicy, dtype: torch.dtype) -> None:
    """bf16 compute with the FSDP2 backend's numerics (`policy.cast_layers`): each decoder layer runs on `dtype` copies
    of the fp32 master weights (the gradients reach the masters in fp32) and takes and returns `dtype` activations; the
    embedding, the final norm (its input cast back to fp32) and the head stay fp32."""
    from asyncrl.learner.policy import cast_layers

    cast_layers(cast(Any, policy), dtype)
    policy.gpt.decoder.final_layernorm.register_forward_pre_hook(_fp32_inputs)


def _fp32_inputs(_module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron's attention mask, [B, 1, L, L] True where a query may NOT attend: later positions and padding keys
    (passed explicitly: megatron's default causal mask is allocated on CUDA)."""
    length = attention_mask.shape[1]
    later = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).triu(1)
    return (later | (attention_mask == 0)[:, None, None, :]).reshape(-1, 1, length, length)


_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _check_right_padded(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> None:
    """Megatron's causal attention stands for the padding mask only on right-padded rows with positions 0..n-1."""
    expected = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    if not bool(((position_ids == expected) | (attention_mask == 0)).all()):
        raise ValueError(
            "learner.training_backend = megatron needs right-padded rows with positions 0..n-1 (one sequence per row)"
        )
