"""`LearnerWorker`: one learner rank as a Ray actor (`LearnerPool` creates and drives them).

The ranks form ONE torch.distributed group (gloo on CPU, nccl on GPU) and shard the policy (and the
optional critic) with FSDP2 (one rank: only with `learner.fsdp` always; `policy.shard`). A rank owns its
process group, its shard of the train state and the step counter; the step itself is `step.RankStep`. Weights
leave the rank as Hugging Face-named safetensors buckets (`export.py`) or in a shared-memory segment
(`weights.segment`), checkpoints as DCP shards (`checkpoint.py`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import numpy as np
import ray
import torch

from asyncrl.algo.sampling import SamplingDistribution
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.state import build_reference, build_train_state
from asyncrl.learner.step import RankStep
from asyncrl.remote import Store, is_remote, staging
from asyncrl.types import StepStats
from asyncrl.weights.adapter import AdapterWeights
from asyncrl.weights.delta import DeltaEncoder
from asyncrl.weights.group import CollectiveSender, CollectiveWeights
from asyncrl.weights.published import ExportedWeights
from asyncrl.weights.segment import SegmentLayout, SegmentWriter, SharedWeights

__all__ = ["LearnerWorker"]


ADAPTER_FOLDER = "adapter"
"""The sub-folder of an `export_hf` folder that holds the PEFT adapter of a `learner.lora` run."""
SEND_GROUP = "weight_send"
"""The rank's Ray concurrency group for `send_collective`: engines pull while the rank trains."""
SEND_THREADS = 32
"""Engines served at once; more wait for a free thread, and a wait counts against their receive's timeout."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LearnerWorker:
    """One learner rank. Construct through `LearnerPool` (it is wrapped with `ray.remote` there); every
    public method except `master_address` is collective: all ranks must call it together."""

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        model_dir: str,
        config,
        recipe,
        sampling: SamplingDistribution,
        dtype: str = "float32",
    ):
        self.rank = rank
        self.num_ranks = num_ranks
        self.model_dir = str(model_dir)
        self.config = config  # asyncrl.config.LearnerConfig
        self.recipe = recipe  # asyncrl.algo.recipes.Recipe
        self.sampling = sampling  # the engines' processed distribution, which the learner's log-probs refer to
        # The decoder layers' compute dtype and the engines' weight dtype; parameters (master weights),
        # optimizer state, gradient reductions and the head stay fp32 whatever it is (`policy.shard`).
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.step = 0
        self._segment: SegmentWriter | None = None
        """The shared-memory weight segment this rank writes (`weight_sync.transport` shared_memory: rank 0, and
        every rank once each writes its own rows, `export_shared`)."""
        self._shm_root: str | None = None
        self._rows_ready = False
        """Every rank writes its own rows of the weights into the segment (no gather on rank 0)."""
        self._sender: CollectiveSender | None = None
        """The staging buffer engines pull from (rank 0, `weight_sync.transport` collective)."""
        self._delta: DeltaEncoder | None = None
        """The last version sent, in the engines' dtype (rank 0, `weight_sync.delta`)."""
        self.reference: torch.nn.Module | None = None
        """The frozen reference policy of the KL term, built when a recipe first needs it (`_reference`)."""
        self.megatron = getattr(config, "training_backend", "fsdp2") == "megatron"
        """`learner.training_backend` megatron: the state, gradient reduction, exports and checkpoints of
        `asyncrl.learner.megatron` instead of FSDP2's."""

    # ------------------------------------------------------------------ setup and collectives

    def pid(self) -> int:
        """This rank's process id (fault injection kills or stops real processes)."""
        return os.getpid()

    def master_address(self) -> tuple[str, int]:
        """Rank 0 picks the rendezvous address (its node IP and a free port)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master: tuple[str, int], timeout_s: float) -> None:
        """Join the process group at rank 0's `master_address`, load and shard the policy (+ critic), build
        the optimizers."""
        from torch.distributed.device_mesh import init_device_mesh

        self._init_process_group(*master, timeout_s)
        mesh = init_device_mesh(self.device.type, (self.num_ranks,))
        torch.manual_seed(self.config.seed)
        self.mesh = mesh
        self.state = self._train_state(mesh)
        reference = self._reference(self.recipe)
        all_reduce = self._all_reduce
        if self.megatron:
            from asyncrl.learner.megatron.state import data_parallel_all_reduce as all_reduce
        self._step = RankStep(
            self.state, self.config, self.recipe, self.sampling, self.device, all_reduce, reference=reference
        )

    def _init_process_group(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        import torch.distributed as dist

        cfg = self.config
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, int(cfg.num_cpus_per_rank)))
        if cfg.cpu_nice:
            lower_priority(cfg.cpu_nice)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.num_ranks,
            timeout=timedelta(seconds=timeout_s),
        )

    def _train_state(self, mesh):
        from asyncrl.learner.policy import shard

        if self.megatron:
            from asyncrl.learner.megatron.state import build_megatron_train_state

            state = build_megatron_train_state(self.config, self.model_dir, self.device, self.dtype)
            self.model_config = state.policy.hf_config
            return state
        state = build_train_state(
            self.config, self.model_dir, self.device, lambda module: shard(module, mesh, self.dtype, self.config.fsdp)
        )
        self.model_config = state.policy.causal_lm.config
        return state

    def _reference(self, recipe):
        """The frozen reference policy (`learner.reference_path`, default the starting weights) when `recipe` has a
        KL-to-reference term, else None; built on the first such recipe (collective: every rank asks together),
        sharded like the policy (`learner.lora` without a `reference_path`: the policy with its adapters off,
        `lora.BaseModelView`, no second model). Not part of the train state, so no checkpoint or export holds it."""
        from asyncrl.learner.policy import shard

        if not recipe.needs_reference:
            return None
        if self.reference is None and self.config.lora is not None and self.config.reference_path is None:
            from asyncrl.learner.lora import BaseModelView

            self.reference = BaseModelView(self.state.policy, self.state.policy.decoder_layers)
        if self.reference is None:
            path, mesh = self.config.reference_path or self.model_dir, self.mesh
            if self.megatron:
                from asyncrl.learner.megatron.state import build_megatron_reference

                self.reference = build_megatron_reference(path, self.config.tensor_parallel, self.device, self.dtype)
                return self.reference
            self.reference = build_reference(
                path, self.device, lambda module: shard(module, mesh, self.dtype, self.config.fsdp)
            )
        return self.reference

    def _all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ training and scoring

    def train_step(self, shards: Sequence[TrainBatch]) -> StepStats:
        """One step on this rank's share of every mini-batch of a rollout batch, all sent in one call so
        that pi_old is computed where the rows are, before the first update (see `RankStep.train`)."""
        stats = self._step.train(shards, self.step)
        self.step = stats.step
        return stats

    def compute_gradients(self, rows: TrainBatch, recipe=None) -> tuple[float, dict[str, np.ndarray] | None]:
        """The full (unsharded) policy gradient of the batch loss, without stepping; -> (loss, grads on
        rank 0 / None elsewhere), by Hugging Face name. `recipe` overrides the pool's for this call."""
        recipe = recipe or self.recipe
        loss, grads = dataclasses.replace(self._step, recipe=recipe, reference=self._reference(recipe)).gradients(rows)
        return loss, (grads if self.rank == 0 else None)

    def score(
        self, token_ids: Sequence[int], prompt_len: int, sampling: SamplingDistribution | None = None
    ) -> np.ndarray:
        """Learner log-probs of `token_ids[prompt_len:]` given their prefixes under `sampling` (default: the
        run's), -inf outside its kept set (the parity probe)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        n = ids.shape[1]
        if not 1 <= prompt_len < n:
            raise ValueError(f"score: need 1 <= prompt_len < len(token_ids) (got {prompt_len}, {n})")
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        with torch.no_grad():
            logprobs = self.state.policy(ids, torch.ones_like(ids), positions, sampling or self.sampling)
        return logprobs[0, prompt_len - 1 : n - 1].cpu().numpy()

    # ------------------------------------------------------------------ weights, snapshots, checkpoints

    def _full_model_state(self, module, keep=lambda name: True) -> dict[str, torch.Tensor]:
        """Full state dict gathered by all ranks (one all-gather per sharded tensor, in the same order on every
        rank; none on one rank, whose shard is the whole tensor); populated on rank 0 (CPU tensors), empty
        elsewhere; `keep(name)` picks the tensors (the same on every rank). The weight sync runs this every step:
        `torch.distributed.checkpoint`'s `get_model_state_dict(full_state_dict=True)` gives the same tensors but
        took 40-90 ms for the 1M-parameter W1 model on this loaded 2-core CPU, against a few ms here.

        On one CPU rank the tensors are the parameters themselves, not copies: every caller serializes or copies
        them before the rank's next call can step the optimizer (a fresh 0.5 GB copy per sync at 125M parameters
        cost more than writing the shared-memory segment)."""
        from torch.distributed.tensor import DTensor

        full = {}
        for name, value in module.state_dict().items():
            if not keep(name):
                continue
            if isinstance(value, DTensor):
                value = value.to_local() if value.device_mesh.size() == 1 else value.full_tensor()
            if self.rank == 0:
                full[name] = value.detach().to("cpu")
        return full

    def _hf_state(self, checkpoint: bool = False) -> dict[str, torch.Tensor]:
        """The policy under Hugging Face names on rank 0 ({} elsewhere), its adapters merged (`learner.lora`);
        `checkpoint`: in a checkpoint's layout, what engines load (`export.checkpoint_layout`)."""
        from asyncrl.learner.export import checkpoint_layout, hf_state_dict

        tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        if self.megatron:
            full = self.state.policy.full_hf_state()  # collective over each TP group
            if self.rank != 0:
                return {}
            state = hf_state_dict(full, tied)
            return self.state.policy.checkpoint_layout(state) if checkpoint else state
        full = self._full_model_state(self.state.policy)
        if self.rank != 0:
            return {}
        if self.config.lora is not None:
            from asyncrl.learner.lora import merged

            full = merged(full, self.config.lora.alpha / self.config.lora.rank)
        state = hf_state_dict(full, tied)
        return checkpoint_layout(self.state.policy.causal_lm, state) if checkpoint else state

    def export_weights(self, bucket_bytes: int) -> ExportedWeights | None:
        """Rank 0 packs the HF-named weights into safetensors buckets and puts them in the object store."""
        import ray

        from asyncrl.learner.export import pack_state_dict

        state = self._hf_state(checkpoint=True)
        if self.rank != 0:
            return None
        buckets, num_bytes, num_tensors = pack_state_dict(state, bucket_bytes, self.dtype)
        return ExportedWeights(refs=[ray.put(b) for b in buckets], num_bytes=num_bytes, num_tensors=num_tensors)

    def export_delta(self, version: int, bucket_bytes: int, full: bool = False) -> ExportedWeights | None:
        """Rank 0 puts in the object store what changed since the last version it exported this way (all of it
        when `full` or the first time): `weights.delta` payloads packed as safetensors buckets."""
        from asyncrl.learner.export import cast_state, put_buckets

        state = self._hf_state(checkpoint=True)
        if self.rank != 0:
            return None
        if self._delta is None:
            self._delta = DeltaEncoder()
        return put_buckets(self._delta.encode(cast_state(state, self.dtype), version, full), bucket_bytes)

    def export_delta_base(self, version: int, bucket_bytes: int) -> ExportedWeights | None:
        """Rank 0 puts in the object store the last version `export_delta` exported, in full (for an engine that
        joins or missed a delta); raises unless that is `version`. No gather: the other ranks do nothing."""
        from asyncrl.learner.export import put_buckets

        if self.rank != 0:
            return None
        held = self._delta.version if self._delta is not None else None
        if held != version:
            raise RuntimeError(f"export_delta_base: rank 0 holds delta version {held}, not {version}")
        assert self._delta is not None
        return put_buckets(self._delta.full(), bucket_bytes)

    def export_shared(self, root: str, version: int, gather: bool = False) -> SharedWeights | None:
        """The HF-named weights into the shared-memory slot of `version` (`weights.segment`); rank 0's record.
        The first export under `root` gathers the full state on rank 0, which writes it and fixes the layout.
        Later ones, when every rank can (`_rows_ready`), have each rank write its own rows of every tensor (FSDP2
        shards dim 0) into the slot: no gather, no full copy on rank 0. `gather`: always gather (measurements)."""
        from asyncrl.learner.export import cast_state

        first, self._shm_root = self._shm_root != root, root
        if not first and not gather and self._rows_ready:
            return self._write_rows(version)
        state = self._hf_state(checkpoint=True)
        record = None
        if self.rank == 0:
            if self._segment is None or self._segment.root != root:
                self._segment = SegmentWriter(root)
            record = self._segment.write(cast_state(state, self.dtype), version)
        if first:
            self._rows_ready = self._can_write_rows(root)
        return record

    def _can_write_rows(self, root: str) -> bool:
        """Collective, after the first export under `root`: whether every rank can write its rows of every tensor
        into the segment under rank 0's layout (several ranks, all on rank 0's node, dim-0 shards, the layout's
        names: a model whose checkpoint layout renames tensors, or a megatron learner, keeps gathering). A rank
        other than 0 maps the slots here."""
        import torch.distributed as dist

        from asyncrl.learner.export import shard_rows

        if self.num_ranks == 1 or self.megatron:
            return False
        node = ray.get_runtime_context().get_node_id()
        held = self._segment.layout if self.rank == 0 and self._segment is not None else None
        box: list[Any] = [(held.to_json(), node) if held is not None else None]
        dist.broadcast_object_list(box, src=0)
        layout_json, rank0_node = box[0]
        layout = SegmentLayout.from_json(layout_json)
        names = {p.name for p in layout.places}
        rows = shard_rows(self.state.policy.state_dict(), self._tied, self.dtype, self.rank)
        ok = node == rank0_node and rows is not None and (set(rows) == names if self.rank == 0 else set(rows) <= names)
        if ok and self.rank != 0:
            self._segment = SegmentWriter(root)
            self._segment.attach(layout)
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _write_rows(self, version: int) -> SharedWeights | None:
        """Every rank writes its rows into the slot of `version` between two barriers; rank 0 stamps it."""
        import torch.distributed as dist

        from asyncrl.learner.export import shard_rows

        rows = shard_rows(self.state.policy.state_dict(), self._tied, self.dtype, self.rank)
        assert rows is not None and self._segment is not None
        if self.rank == 0:
            self._segment.begin(version)
        dist.barrier()
        self._segment.write_rows(rows, version)
        dist.barrier()
        return self._segment.finish(version) if self.rank == 0 else None

    @property
    def _tied(self) -> bool:
        return bool(getattr(self.model_config, "tie_word_embeddings", False))

    def export_collective(
        self, version: int, loopback: bool, bucket_bytes: int, timeout_s: float
    ) -> CollectiveWeights | None:
        """Rank 0 copies the HF-named weights into its staging buffer, which engines pull over their own process
        group (`send_collective`; `weights.group`). `loopback`: every engine is on this node (127.0.0.1)."""
        from asyncrl.learner.export import cast_state

        state = self._hf_state(checkpoint=True)
        if self.rank != 0:
            return None
        if self._sender is None:
            host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
            self._sender = CollectiveSender(host, self.device, bucket_bytes, timeout_s)
        record = self._sender.stage(cast_state(state, self.dtype), version)
        return dataclasses.replace(record, sender=ray.get_runtime_context().current_actor)

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """The policy's adapters (`learner.lora`) under PEFT's names on rank 0 ({} elsewhere)."""
        from asyncrl.learner.lora import adapter_state, is_adapter
        from asyncrl.learner.policy import hf_name

        if self.config.lora is None:
            raise ValueError("this learner trains every weight (learner.lora is not set): it has no adapter to export")
        full = self._full_model_state(self.state.policy, keep=is_adapter)
        return adapter_state({hf_name(k): v for k, v in full.items()}) if self.rank == 0 else {}

    def export_adapter(self) -> AdapterWeights | None:
        """Rank 0's record of the adapters in the engines' dtype (`weights.adapter`): only they travel."""
        from safetensors.torch import save

        from asyncrl.learner.export import cast_state
        from asyncrl.learner.lora import peft_config

        state = self._adapter_state()
        if self.rank != 0:
            return None
        data = save({k: v.contiguous() for k, v in cast_state(state, self.dtype).items()})
        return AdapterWeights(data, peft_config(self.config.lora, self.model_dir), len(state))

    @ray.method(concurrency_group=SEND_GROUP)
    def send_collective(self, key: str) -> int:
        """Broadcast the staged version to the engine that asked (its group `key`); -> that version. Runs in its
        own threads (`SEND_GROUP`), next to the rank's calls in order (the next `train_step`), and only on
        rank 0, which `export_collective` names in its record."""
        assert self._sender is not None, "send_collective before export_collective staged a version"
        return self._sender.send(key)

    def state_snapshot(self) -> dict[str, Any] | None:
        """Full parameters (HF names) and optimizer state as numpy on rank 0, for tests and debugging."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        params = self._hf_state()
        if self.megatron:  # AdamW's moments are TP pieces under megatron names: parameters only
            lr = self.state.optimizer.param_groups[0]["lr"]
            params_np = {k: v.float().numpy().copy() for k, v in params.items()}
            return {"params": params_np, "optimizer": {}, "lr": lr, "step": self.step} if self.rank == 0 else None
        optim = get_optimizer_state_dict(
            self.state.policy, self.state.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank != 0:
            return None
        moments = {
            f"{hf_name_}/{key}": torch.as_tensor(value).float().numpy()
            # a torch optimizer's state: parameter name -> {moment name: tensor or scalar}
            for name, entry in cast(dict[str, dict[str, Any]], optim["state"]).items()
            for key, value in entry.items()
            for hf_name_ in [name.removeprefix("causal_lm.")]
        }
        return {
            "params": {
                k: v.float().numpy().copy() for k, v in params.items()
            },  # a snapshot, not views of the live parameters
            "optimizer": moments,
            "lr": self.state.optimizer.param_groups[0]["lr"],
            "step": self.step,
        }

    def memory(self) -> dict[str, int]:
        """What this rank holds (`memory.held_bytes`: its shards of the parameters and optimizer state) and its
        process's resident memory now and at its peak, in bytes. Not collective."""
        from asyncrl.learner.memory import held_bytes, resident_bytes

        return {**held_bytes(self.state), **resident_bytes()}

    def save_checkpoint(self, folder: str, store: Store | None = None) -> None:
        from asyncrl.learner.checkpoint import save_train_state

        if self.megatron:
            from asyncrl.learner.megatron.state import save_megatron_state

            _local_only(folder)
            return save_megatron_state(folder, self.state, self.rank, self.step)
        save_train_state(folder, self.state, self.rank, self.step, store)

    def load_checkpoint(self, folder: str, store: Store | None = None) -> int:
        from asyncrl.learner.checkpoint import load_train_state

        if self.megatron:
            from asyncrl.learner.megatron.state import load_megatron_state

            _local_only(folder)
            self.step = load_megatron_state(folder, self.state, self.rank)
            return self.step
        self.step = load_train_state(folder, self.state, self.rank, store)
        return self.step

    def export_hf(self, folder: str, store: Store | None = None) -> None:
        """A Hugging Face folder (config, tokenizer, safetensors) that transformers and vLLM load (`learner.lora`:
        the merged model, and the adapter alone in its `adapter` sub-folder, `_write_hf`); to an object store
        (`folder` a URI) it is written in this node's staging copy, then replaces the remote folder."""
        state = self._hf_state()
        adapter = self._adapter_state() if self.config.lora is not None else None
        if self.rank != 0:
            return
        if not is_remote(folder):
            self._write_hf(state, folder, adapter)
            return
        local = staging(folder)
        shutil.rmtree(local, ignore_errors=True)
        self._write_hf(state, str(local), adapter)
        store = store or Store()
        store.remove(folder)
        store.upload(local, folder)

    def _write_hf(self, state: dict[str, torch.Tensor], folder: str, adapter: dict[str, torch.Tensor] | None) -> None:
        """The merged model at `folder` and, with `adapter` (`learner.lora`), the PEFT adapter folder
        `folder/adapter` (fp32) that `peft.PeftModel.from_pretrained` and vLLM's LoRA load on the run's base model."""
        from transformers import AutoModelForCausalLM

        from asyncrl.learner.checkpoint import copy_tokenizer_files
        from asyncrl.learner.lora import peft_config, write_adapter

        copy_tokenizer_files(self.model_dir, folder)
        model = AutoModelForCausalLM.from_config(self.model_config, dtype=self.dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"export_hf: state dict does not match the model (missing {missing}, unexpected {unexpected})"
            )
        model.save_pretrained(folder, safe_serialization=True)
        if adapter is not None:
            write_adapter(os.path.join(folder, ADAPTER_FOLDER), adapter, peft_config(self.config.lora, self.model_dir))

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._segment is not None:
            self._segment.close()

        if dist.is_initialized():
            dist.destroy_process_group()


def _local_only(folder: str) -> None:
    """Megatron checkpoints are written to a mounted folder only (no object-store staging yet)."""
    if is_remote(folder):
        raise ValueError(
            f"learner.training_backend = megatron: checkpoint {folder} is on an object store, which the megatron "
            "backend does not support yet; use a mounted folder (storage.uri)"
        )


def lower_priority(nice: int) -> None:
    """Run every thread of this process (and those it starts later) at niceness `nice` at least (`learner.cpu_nice`);
    on Linux a niceness is per thread, so each of /proc/self/task is set."""
    tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tasks:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass  # a thread that ended meanwhile
