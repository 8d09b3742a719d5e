"""`LearnerPool`: the driver-side handle on every learner rank (`rank.LearnerWorker` actors).

One step per rollout batch, of `learner.epochs` x `learner.mini_batches` optimizer updates:

    pool: groups -> build_batch (outcome advantages over the WHOLE rollout batch)
          -> split_mini_batches (whole groups, reduction weights over each mini-batch)
          -> split_rows of each (token-balanced; whole groups for gvpo)
          -> each rank's train_step with its share of every mini-batch (step.py) -> merge the ranks' metrics

The pool holds the step counter but not the policy version: the controller owns it and hands it to
`save_checkpoint`; `load_checkpoint` gives it back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from asyncrl.algo.metrics import lag_mismatch_figures
from asyncrl.algo.sampling import RAW, SamplingDistribution
from asyncrl.learner.batch import TrainBatch, build_batch, loss_needs_whole_groups, split_mini_batches, split_rows
from asyncrl.learner.merge import merge_metrics
from asyncrl.learner.rank import SEND_GROUP, SEND_THREADS, LearnerWorker
from asyncrl.models.shipping import ShippedModel, materialise, ship
from asyncrl.remote import Store
from asyncrl.types import Group, StepStats
from asyncrl.weights.adapter import AdapterWeights
from asyncrl.weights.group import CollectiveWeights
from asyncrl.weights.published import ExportedWeights
from asyncrl.weights.segment import SharedWeights

__all__ = [
    "LearnerCall",
    "LearnerCallError",
    "LearnerCheckpoint",
    "LearnerPool",
    "recipe_from_config",
    "resized_config",
]


def recipe_from_config(cfg):
    """The run's `Recipe`: `algorithm` preset, overrides and params; Dr. GRPO's fixed L_max defaults to
    `rollout.max_tokens` (the longest response the engines may produce)."""
    from asyncrl.algo.recipes import resolve_recipe

    algo = cfg.algorithm
    params = dict(algo.params)
    if algo.resolved_names()["reduction"] == "seq_mean_token_sum_norm":
        params.setdefault("l_max", cfg.rollout.max_tokens)
    return resolve_recipe(algo.preset, algo.advantage, algo.loss, algo.reduction, algo.correction, **params)


def resized_config(learner, num_ranks: int):
    """The `LearnerConfig` of a pool of `num_ranks` ranks, checked as the config file's would be (raises
    ValueError naming `learner.num_ranks`)."""
    from pydantic import ValidationError

    try:
        return type(learner).model_validate({**learner.model_dump(), "num_ranks": num_ranks})
    except ValidationError as e:
        reasons = "; ".join(str(err["msg"]) for err in e.errors())
        raise ValueError(f"learner.num_ranks = {num_ranks} is refused: {reasons}") from None


_DEATH_GRACE_S = 5.0


def _call_error(ref) -> tuple[str, str] | None:
    """None if the call succeeded, else ("died" | "failed", what happened)."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref)
    except RayActorError as e:
        return "died", type(e).__name__
    except Exception as e:
        return "failed", str(e)
    return None


class NodeLocalLearnerWorker(LearnerWorker):
    """A `LearnerWorker` that reads the model from its own node: a shipped preset is unpacked into the node's
    cache first (`model_dir` is the driver's path, which another node may not have)."""

    def __init__(self, rank: int, num_ranks: int, model_dir: str, *args, model: ShippedModel | None = None):
        super().__init__(rank, num_ranks, str(materialise(model)) if model is not None else model_dir, *args)


@dataclass(frozen=True)
class LearnerCall:
    """A call started on every rank and not yet waited for (`LearnerPool._submit`)."""

    method: str
    refs: list[Any]
    """One object ref per rank, in rank order."""
    submitted: float
    """`time.monotonic()` at submission: the call's timeout counts from here."""


class LearnerCallError(RuntimeError):
    """A call on the learner ranks failed or timed out; the message names the rank and the call."""


@dataclass(frozen=True)
class LearnerCheckpoint:
    """What `LearnerPool.load_checkpoint` restored: the optimizer step count, the policy version the caller
    saved with it, and the caller's `extra` state (JSON), untouched."""

    step: int
    version: int
    extra: dict[str, Any]


class LearnerPool:
    """Driver-side handle on `num_ranks` LearnerWorker actors forming one torch.distributed group."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config,
        recipe,
        sampling: SamplingDistribution = RAW,
        dtype: str = "float32",
        init_timeout_s: float = 300.0,
        placement_timeout_s: float = 300.0,
        store: Store | None = None,
    ):
        import ray

        from asyncrl.cluster import placement
        from asyncrl.learner.memory import check_rank_memory

        check_rank_memory(config, str(model_dir), recipe.needs_reference)  # `learner.rank_memory_gb`, before any rank
        self.config = config
        self.recipe = recipe
        self.store = store
        """How checkpoints and exports reach an object store (folders given as `s3://`/`gs://` URIs)."""
        self.num_ranks = config.num_ranks
        self.tensor_parallel = getattr(config, "tensor_parallel", 1)
        self.step = 0
        unit = placement.bundle(config.num_cpus_per_rank, config.num_gpus_per_rank, config.resources)
        # The learner reserves its ranks before the rollout pool starts: scaling rollouts never starves it.
        self.group = placement.reserve(
            "learner", [unit] * self.num_ranks, config.placement_strategy, placement_timeout_s
        )
        # Ray's typed overloads of `remote` leave out its documented `concurrency_groups` option.
        actor = ray.remote(concurrency_groups={SEND_GROUP: SEND_THREADS})(NodeLocalLearnerWorker)  # type: ignore[call-overload]
        model = ship(model_dir)
        self.workers = [
            actor.options(
                num_cpus=config.num_cpus_per_rank,
                num_gpus=config.num_gpus_per_rank,
                scheduling_strategy=placement.in_bundle(self.group, rank),
            ).remote(rank, self.num_ranks, str(model_dir), config, recipe, sampling, dtype, model=model)
            for rank in range(self.num_ranks)
        ]
        # Ray resolves rank 0's address before each rank's `setup` runs. Nothing waits here: the ranks load
        # the model while the caller goes on (the run starts its engines); the first call waits (`_submit`).
        address = self.workers[0].master_address.remote()
        self._setup: LearnerCall | None = self._submit_now("setup", address, init_timeout_s)
        self._setup_timeout_s = init_timeout_s + 60

    @classmethod
    def from_config(cls, cfg, model_dir: str | os.PathLike, num_ranks: int | None = None) -> LearnerPool:
        """Build from the run's `asyncrl.config.Config` (recipe from `algorithm`, sampling from `rollout`);
        `num_ranks` (default `learner.num_ranks`): the size of a re-formed pool (`resized_config`)."""
        sampling = SamplingDistribution(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
        return cls(
            model_dir,
            resized_config(cfg.learner, num_ranks) if num_ranks is not None else cfg.learner,
            recipe_from_config(cfg),
            sampling,
            cfg.model.dtype,
            init_timeout_s=cfg.learner.setup_timeout_s,
            placement_timeout_s=cfg.cluster.placement_timeout_s,
            store=cfg.storage.store(),
        )

    def _call(
        self, method: str, *args, timeout_s: float | None = None, per_rank: Sequence[tuple] | None = None
    ) -> list:
        """Call `method` on every rank at once (collective) and wait, at most `timeout_s` (default
        `learner.call_timeout_s`) in all; a failure or a timeout names the rank and the call."""
        return self._collect(self._submit(method, *args, per_rank=per_rank), timeout_s)

    def wait_ready(self) -> None:
        """Wait until every rank has set up (joined the group, loaded the model); a failure or a timeout names
        the rank. Every call on the ranks waits for this first."""
        if self._setup is not None:
            call, self._setup = self._setup, None
            self._collect(call, self._setup_timeout_s)

    def _submit(self, method: str, *args, per_rank: Sequence[tuple] | None = None) -> LearnerCall:
        """Start `method` on every rank without waiting, once they are set up. Each rank runs its calls in
        submission order, so a call submitted later (the next `train_step`) runs after this one on every rank."""
        self.wait_ready()
        return self._submit_now(method, *args, per_rank=per_rank)

    def _submit_now(self, method: str, *args, per_rank: Sequence[tuple] | None = None) -> LearnerCall:
        refs = [
            getattr(w, method).remote(*(per_rank[r] if per_rank is not None else args))
            for r, w in enumerate(self.workers)
        ]
        return LearnerCall(method, refs, time.monotonic())

    def _collect(self, call: LearnerCall, timeout_s: float | None = None) -> list:
        """Wait for every rank's result of `call`, at most `timeout_s` (default `learner.call_timeout_s`) from
        its submission. A rank that died takes its peers' collectives down with it, so a dead rank is named
        before their errors."""
        import ray

        timeout_s = timeout_s if timeout_s is not None else self.config.call_timeout_s
        refs, method = call.refs, call.method
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        deadline, pending, failed = call.submitted + timeout_s, list(refs), None
        while pending:
            # After a first failure, wait only a few seconds more: long enough for a peer's death to surface.
            wait_s = deadline - time.monotonic() if failed is None else min(_DEATH_GRACE_S, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, wait_s))
            if not done:
                break
            error = _call_error(done[0])
            if error is not None and error[0] == "died":
                raise LearnerCallError(f"learner rank {rank_of[done[0]]}: {method} failed: the rank died ({error[1]})")
            failed = failed or (error and (rank_of[done[0]], error[1]))
        if failed:
            raise LearnerCallError(f"learner rank {failed[0]}: {method} failed: {failed[1]}")
        if pending:
            raise LearnerCallError(
                f"learner rank {rank_of[pending[0]]}: {method} did not answer within {timeout_s}s "
                "(learner.call_timeout_s)"
            )
        return ray.get(refs)

    # ------------------------------------------------------------------ training

    def make_batch(self, groups: Sequence[Group], recipe=None, lags: Sequence[int] | None = None) -> TrainBatch:
        return build_batch(groups, recipe or self.recipe, lags)

    def train_step(self, groups: Sequence[Group], lags: Sequence[int] | None = None) -> StepStats:
        """One step on `groups` (the readiness units the buffer handed out); with `lags` (`Batch.lags`) the
        mismatch figures are also reported per staleness bucket (`mismatch_<figure>/lag=<lag>`)."""
        return self.finish_step(self.start_step(groups, lags))

    def start_step(self, groups: Sequence[Group], lags: Sequence[int] | None = None) -> LearnerCall:
        """`train_step` without the wait: the ranks train while the caller does other work; `finish_step`
        collects the result."""
        return self._start_batch(self.make_batch(groups, lags=lags))

    def train_batch(self, batch: TrainBatch) -> StepStats:
        """One step on a rollout batch: its mini-batches, each split over the ranks."""
        return self.finish_step(self._start_batch(batch))

    def _start_batch(self, batch: TrainBatch) -> LearnerCall:
        self.wait_ready()
        began = time.monotonic()  # `learner_step_s` and the call's timeout count the split too
        keep_groups = loss_needs_whole_groups(self.recipe)
        parts = split_mini_batches(batch, self.config.mini_batches, self.recipe)
        replicas = self.num_ranks // self.tensor_parallel
        shards = [split_rows(part, replicas, keep_groups, self._shares_prompts) for part in parts]
        # The ranks of one tensor-parallel group (consecutive ranks, megatron) train on the same rows.
        per_rank = [([part[rank // self.tensor_parallel] for part in shards],) for rank in range(self.num_ranks)]
        return replace(self._submit("train_step", per_rank=per_rank), submitted=began)

    @property
    def _shares_prompts(self) -> bool:
        """Whether the ranks keep a group's prompt-sharing rows together (`learner.share_group_prompt`)."""
        config = self.config
        return config.packing and config.share_group_prompt and config.training_backend == "fsdp2"

    def finish_step(self, call: LearnerCall) -> StepStats:
        """The ranks' results of a step merged into one; `learner_step_s` counts from its submission."""
        results: list[StepStats] = self._collect(call)[:: self.tensor_parallel]  # one per data-parallel replica
        self.step = results[0].step
        metrics = lag_mismatch_figures(merge_metrics([(r.metrics, r.metrics.get("loss_tokens", 0.0)) for r in results]))
        metrics.pop("loss_tokens", None)
        metrics["learner_step_s"] = time.monotonic() - call.submitted
        return StepStats(
            step=self.step,
            loss=results[0].loss,
            grad_norm=results[0].grad_norm,
            num_samples=sum(r.num_samples for r in results),
            num_tokens=sum(r.num_tokens for r in results),
            metrics=metrics,
        )

    def compute_gradients(self, batch: TrainBatch, recipe=None) -> tuple[float, dict[str, np.ndarray]]:
        """(batch loss, full policy gradient by HF name) without an optimizer step (tests, debugging).
        `recipe` (default: the pool's) must be the one `batch` was built with."""
        recipe = recipe or self.recipe
        replicas = self.num_ranks // self.tensor_parallel  # a tensor-parallel group's ranks take the same rows
        shards = split_rows(batch, replicas, loss_needs_whole_groups(recipe), self._shares_prompts)
        per_rank = [(shards[rank // self.tensor_parallel], recipe) for rank in range(self.num_ranks)]
        loss, grads = self._call("compute_gradients", per_rank=per_rank)[0]
        return loss, grads

    def score(
        self, token_ids: Sequence[int], prompt_len: int, sampling: SamplingDistribution | None = None
    ) -> np.ndarray:
        """Learner log-probs of `token_ids[prompt_len:]` under `sampling` (default: the run's)."""
        return self._call("score", list(token_ids), prompt_len, sampling)[0]

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self, bucket_bytes: int) -> ExportedWeights:
        """Gather the policy, pack HF-named safetensors buckets (tied lm_head explicit) and put them in the
        object store; the refs are owned by rank 0."""
        return self._call("export_weights", bucket_bytes)[0]

    def export_delta(self, version: int, bucket_bytes: int, full: bool = False) -> ExportedWeights:
        """Gather the policy and put in the object store what changed since the last `export_delta` (all of it
        when `full` or the first time), as `asyncrl.weights.delta` payloads in safetensors buckets (rank 0)."""
        return self._call("export_delta", version, bucket_bytes, full)[0]

    def export_delta_base(self, version: int, bucket_bytes: int) -> ExportedWeights:
        """`version`, the last `export_delta`, in full from rank 0's copy (no gather, no new weights)."""
        return self._call("export_delta_base", version, bucket_bytes)[0]

    def export_shared(self, root: str, version: int) -> SharedWeights:
        """Gather the policy and copy it (HF names, tied lm_head explicit) into the shared-memory slot of
        `version` under `root` (rank 0 writes; `asyncrl.weights.segment`)."""
        return self._call("export_shared", root, version)[0]

    def start_export_shared(self, root: str, version: int) -> LearnerCall:
        """`export_shared` without the wait: the ranks gather and write the slot before they run any call
        submitted after this one (the next `train_step`); `call.refs[0]` resolves to rank 0's `SharedWeights`,
        so an engine can be handed it before it is written. `finish_call` raises as `export_shared` does."""
        return self._submit("export_shared", root, version)

    def export_collective(self, version: int, loopback: bool, bucket_bytes: int, timeout_s: float) -> CollectiveWeights:
        """Gather the policy and stage it (HF names, tied lm_head explicit) on rank 0, for engines to pull over
        their own process group (`asyncrl.weights.group`); -> rank 0's record, its actor handle included."""
        return self.finish_call(self.start_export_collective(version, loopback, bucket_bytes, timeout_s))[0]

    def start_export_collective(self, version: int, loopback: bool, bucket_bytes: int, timeout_s: float) -> LearnerCall:
        """`export_collective` without the wait, as `start_export_shared` is."""
        return self._submit("export_collective", version, loopback, bucket_bytes, timeout_s)

    def export_adapter(self) -> AdapterWeights:
        """Gather the policy's adapters (`learner.lora`) on rank 0: PEFT-named safetensors bytes and config."""
        return self._call("export_adapter")[0]

    def finish_call(self, call: LearnerCall) -> list:
        """Every rank's result of a call started without waiting (`start_export_shared`), errors named by rank."""
        return self._collect(call)

    def state_snapshot(self) -> dict[str, Any]:
        return self._call("state_snapshot")[0]

    def save_checkpoint(self, folder: str | os.PathLike, version: int, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, schedulers, RNG (+ critic) of every rank, then `extra` (JSON) and the
        step/version marker that makes the checkpoint complete. `version`: the caller's policy version."""
        from asyncrl.learner.checkpoint import write_learner_state

        self._call("save_checkpoint", str(folder), self.store)
        write_learner_state(
            folder, step=self.step, version=version, num_ranks=self.num_ranks, extra=extra or {}, store=self.store
        )

    def load_checkpoint(self, folder: str | os.PathLike) -> LearnerCheckpoint:
        """Restore a complete checkpoint into this pool (any number of ranks)."""
        from asyncrl.learner.checkpoint import read_learner_state

        state, extra = read_learner_state(folder, self.store)
        self._call("load_checkpoint", str(folder), self.store)
        self.step = int(state["step"])
        return LearnerCheckpoint(step=self.step, version=int(state["version"]), extra=extra)

    def export_hf(self, folder: str | os.PathLike) -> None:
        """A Hugging Face folder of the policy at `folder` (a path, or an object-store URI it replaces whole)."""
        self._call("export_hf", str(folder), self.store)

    def memory(self) -> list[dict[str, int]]:
        """Each rank's held and resident bytes, in rank order (`LearnerWorker.memory`)."""
        return self._call("memory")

    def shutdown(self) -> None:
        import ray

        from asyncrl.cluster import placement

        try:
            if self._setup is None:  # ranks still setting up have nothing to flush: they are killed
                self._call("shutdown", timeout_s=30)
        finally:
            for w in self.workers:
                ray.kill(w)
            placement.release(self.group)
