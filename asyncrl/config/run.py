"""The root of the tree (`Config`: a run is one) and the sections of running it: checkpoints, cluster placement,
storage, fault injection."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from asyncrl.algo import registry
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.base import Mode, Section
from asyncrl.config.buffer import BufferConfig
from asyncrl.config.learner import LearnerConfig, WeightSyncConfig
from asyncrl.config.model import DataConfig, ModelConfig
from asyncrl.config.observe import EvalConfig, TelemetryConfig
from asyncrl.config.rollout import EnvConfig, RolloutConfig, ToolsConfig
from asyncrl.redaction import redact
from asyncrl.remote import Store, is_remote, join, staging


class CheckpointConfig(Section):
    every_steps: int = Field(50, ge=0)
    """Checkpoint period in optimizer steps (0 = only at the end). A run killed between checkpoints resumes
    from the last one (`resume_from: latest`) with its version, counters and queue."""
    resume_from: str | None = None
    """A checkpoint folder to resume from, or `latest` for the newest in the output folder."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face safetensors folder (`final_model/`)."""
    export_best: bool = False
    """Also keep the best policy the run evaluated: each held-out evaluation that beats every earlier one
    exports it to `best_model/` (replacing it whole; `best_model/asyncrl_eval.json` names the evaluation).
    `summary.json`'s `best_eval` names the best evaluation either way."""


class ClusterConfig(Section):
    """How the pools are placed on a Ray cluster (each pool gets its own placement group)."""

    placement_timeout_s: float = Field(300.0, gt=0)
    """A pool whose placement group is not placed within this time fails, naming the pool, what its bundles
    ask for and what the cluster has free."""


class StorageConfig(Section):
    """Where a run's files go (docs/storage.md). Every node that writes them (the driver, learner ranks, the
    replay queue) must reach the same place on a multi-node cluster: a mounted folder or an object store."""

    uri: str | None = None
    """A folder every node mounts (NFS, a Kubernetes volume; `file://` URIs too) or an object store
    (`s3://bucket/prefix`, `gs://bucket/prefix`; credentials from the environment): the run directory becomes
    `<uri>/<output_dir>` (checkpoints, final_model, metrics.jsonl, summary.json, trajectories). None = the
    local `output_dir`, as on one machine."""
    mode: Literal["private", "group", "world"] = "private"
    """Who may read the run's files: `private` (the run folder 0700, its files 0600: prompts, answers, rewards
    and checkpoints are the owner's alone), `group` (0750/0640) or `world` (0755/0644). The folder gets its
    mode when it is created (before anything is written into it); its files and folders at each end of the
    run (`Config.seal_run_dir`)."""

    @property
    def folder_mode(self) -> int:
        return {"private": 0o700, "group": 0o750, "world": 0o755}[self.mode]

    @property
    def file_mode(self) -> int:
        return self.folder_mode & 0o666

    endpoint_url: str | None = None
    """An S3-compatible server's address for `s3://` URIs (MinIO, Ceph; `AWS_ENDPOINT_URL` works too); None =
    AWS itself. Credentials never go here: they come from each node's environment (`AWS_*`)."""
    sync_every_s: float = Field(10.0, gt=0)
    """With an object store: how often the driver uploads what changed in its local copy of the run folder
    (metrics.jsonl, events.jsonl, ...); everything is uploaded again at the end of the run."""
    request_timeout_s: float = Field(20.0, gt=0)
    """With an object store: connect and read timeout of one request (a server that stopped answering)."""
    outage_timeout_s: float = Field(600.0, gt=0)
    """With an object store: how long a write is retried (with backoff, each failure logged) before it fails.
    A background upload that fails this long stops the run with a checkpoint (kept locally when it cannot be
    uploaded either); a checkpoint, export or final upload that fails this long fails the run, naming the
    local copy that holds what was not uploaded."""

    @model_validator(mode="after")
    def _supported(self) -> StorageConfig:
        from asyncrl.remote import SCHEMES

        scheme = self.uri.split("://", 1)[0] if self.uri and "://" in self.uri else None
        if scheme not in (None, "file", *SCHEMES):
            raise ValueError(
                f"storage.uri {self.uri!r}: a path, file://, s3:// or gs:// URI is supported, not {scheme}://"
            )
        for key, value in (("storage.uri", self.uri), ("storage.endpoint_url", self.endpoint_url)):
            if value and "@" in value.split("://", 1)[-1].split("/", 1)[0]:
                raise ValueError(f"{key}: no credentials in the URI; set them in the environment (AWS_* variables)")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"storage.endpoint_url {self.endpoint_url!r}: an http:// or https:// address")
        if scheme in SCHEMES and self.uri and len(self.uri.split("://", 1)[1].strip("/")) == 0:
            raise ValueError(f"storage.uri {self.uri!r} names no bucket")
        return self

    def store(self) -> Store:
        """How the run's processes talk to the object store (`asyncrl.remote.Store`)."""
        return Store(self.endpoint_url, self.request_timeout_s, self.outage_timeout_s)


class ChaosConfig(Section):
    """Faults at random steps (seeded): each SIGKILLs or SIGSTOPs the processes of one serving rollout engine,
    chosen at random, on the driver's node (psutil), right after a weight sync starts."""

    kills: int = Field(0, ge=0, le=100)
    """Engines SIGKILLed (a crash, an OOM kill)."""
    stops: int = Field(0, ge=0, le=100)
    """Engines SIGSTOPped with their engine-core processes (a hang: alive, not answering); the heartbeat finds
    them (`rollout.heartbeat_timeout_s`) and the run kills what it stopped."""
    seed: int = 0
    """Seeds the steps, the order of the kinds and the engines hit."""
    first_step: int = Field(1, ge=1)
    """Faults fall on distinct steps from this one ..."""
    last_step: int = Field(0, ge=0)
    """... to this one (0: `learner.max_steps`), never on a `kill_rollout_worker_at_steps` step."""


class FaultsConfig(Section):
    """Fault injection for tests and soak runs: real processes are killed, nothing is mocked."""

    kill_rollout_worker_at_steps: list[int] = Field(default_factory=list)
    """After each of these optimizer steps, right after its weight sync starts (so the engine dies while it
    loads), SIGKILL the process of one rollout worker (the oldest serving one). While none serves (every engine
    hit is being replaced) the kill waits for the next step that has one; one injected fault per step."""
    nan_reward_at_steps: list[int] = Field(default_factory=list)
    """Give one trajectory of the batch of each of these optimizer steps a NaN reward before the learner sees
    it (a broken reward path): the step must be skipped and the weights stay finite."""
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    """Engine kills and stops at random steps (`ChaosConfig`)."""
    learner_delay_s: dict[int, float] = Field(default_factory=dict)
    """A learner made slow (or fast again) at a step: from step N (key) on, the driver waits S seconds (value) in
    each optimizer step while the ranks train, e.g. `{1: 0, 20: 2.0}`. The wait counts as training, not as
    waiting for data (what `rollout.autoscale` reads)."""

    @model_validator(mode="after")
    def _delays(self) -> FaultsConfig:
        for step, seconds in self.learner_delay_s.items():
            if step < 1 or not 0 <= seconds <= 3600:
                raise ValueError(
                    f"faults.learner_delay_s: {{{step}: {seconds}}} wants a step >= 1 and 0 to 3600 seconds"
                )
        return self

    def learner_delay(self, step: int) -> float:
        """`learner_delay_s` at `step`: the value of the last key at or before it (0 before the first)."""
        keys = [k for k in self.learner_delay_s if k <= step]
        return self.learner_delay_s[max(keys)] if keys else 0.0


class Config(Section):
    mode: Mode = "streaming"
    """`sync` (eta = 0 baseline), `streaming` (ScaleRL/PipelineRL), or `sao` (single rollout, critic, DIS)."""
    output_dir: str = "runs/default"
    """Folder for the resolved config, summary, logs and checkpoints of this run."""
    seed: int = 0
    """Global seed."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _preset_filters(self) -> Config:
        """The chosen preset's buffer filters become the defaults of those `buffer.*` fields: a value the
        user set (in the file or an override) wins."""
        for key, value in registry.PRESET_FILTERS.get(self.algorithm.preset or "", {}).items():
            if key not in self.buffer.model_fields_set:
                setattr(self.buffer, key, value)
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        names = self.algorithm.resolved_names()
        advantage, loss = (
            registry.COMPONENTS["advantage"][names["advantage"]],
            registry.COMPONENTS["loss"][names["loss"]],
        )
        if advantage.needs_group and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"advantage {names['advantage']!r} needs a group: set rollout.samples_per_prompt >= 2 "
                f"(got {self.rollout.samples_per_prompt})"
            )
        if loss.needs_group and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"loss {loss.name!r} needs rollout.samples_per_prompt >= 2")
        if advantage.needs_critic and not self.learner.critic:
            raise ValueError(f"advantage {names['advantage']!r} needs a critic: set learner.critic = true")
        if self.mode == "sync" and not self.buffer.staleness.synchronous:
            raise ValueError(
                f"mode 'sync' is on-policy: buffer.max_staleness must be 0 (got {self.buffer.max_staleness})"
            )
        if self.mode == "sao" and self.rollout.samples_per_prompt != 1:
            raise ValueError(
                "mode 'sao' is single-rollout: rollout.samples_per_prompt must be 1 "
                f"(got {self.rollout.samples_per_prompt})"
            )
        if self.learner.prompts_per_step % self.learner.mini_batches:
            raise ValueError(
                f"learner.prompts_per_step ({self.learner.prompts_per_step}) must split into learner.mini_batches "
                f"({self.learner.mini_batches}) equal mini-batches of whole groups"
            )
        if (self.env.max_total_tokens or 0) > self.rollout.max_model_len:
            raise ValueError(
                f"env.max_total_tokens ({self.env.max_total_tokens}) exceeds "
                f"rollout.max_model_len ({self.rollout.max_model_len})"
            )
        if self.data.task == "parquet" and not self.data.train_path:
            raise ValueError("data.task 'parquet' needs data.train_path")
        room = self.rollout.max_model_len - self.rollout.max_tokens
        if (self.data.max_prompt_tokens or 0) > room:
            raise ValueError(
                f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) leaves no room for rollout.max_tokens "
                f"({self.rollout.max_tokens}) in rollout.max_model_len ({self.rollout.max_model_len}): at most {room}"
            )
        if self.learner.lora is not None and self.weight_sync.delta:
            raise ValueError(
                "weight_sync.delta does not apply with learner.lora: only the adapters travel at each sync "
                "(set weight_sync.delta to false)"
            )
        self._collective_placement()
        return self

    def _collective_placement(self) -> None:
        """`weight_sync.transport: collective` joins learner rank 0 and each engine in a group of their own: gloo
        between CPUs, NCCL between GPUs, so both sides need the same kind of device; and NCCL refuses two ranks on
        one GPU, so the learner rank needs whole GPUs (with a share, Ray can put an engine on rank 0's GPU)."""
        if self.weight_sync.transport != "collective":
            return
        learner_gpus, engine_gpus = self.learner.num_gpus_per_rank, self.rollout.num_gpus_per_worker
        if (learner_gpus > 0) != (engine_gpus > 0):
            raise ValueError(
                "weight_sync.transport 'collective' connects the learner and the engines over gloo (CPU to CPU) "
                f"or NCCL (GPU to GPU): learner.num_gpus_per_rank ({learner_gpus:g}) and "
                f"rollout.num_gpus_per_worker ({engine_gpus:g}) must both be 0 or both be > 0"
            )
        if learner_gpus % 1:
            raise ValueError(
                "weight_sync.transport 'collective' on GPUs needs whole GPUs per learner rank: "
                f"learner.num_gpus_per_rank is {learner_gpus:g}, so an engine can share rank 0's GPU, where NCCL "
                "refuses two ranks; use a whole number, or transport shared_memory or object_store"
            )

    def run_dir(self) -> Path:
        """The run's folder on this machine: `output_dir`, under `storage.uri` when one is set (with an object
        store: this node's staging copy of `run_uri()`, which the run uploads)."""
        if self.storage.uri is None:
            return Path(self.output_dir)
        if is_remote(self.storage.uri):
            return staging(self.run_uri())
        root = self.storage.uri.removeprefix("file://")
        return Path(root) / self.output_dir.lstrip("/")

    def run_uri(self) -> str:
        """Where the run's files end up: `<storage.uri>/<output_dir>` on an object store, else `run_dir()`."""
        if self.storage.uri is not None and is_remote(self.storage.uri):
            return join(self.storage.uri, self.output_dir)
        return str(self.run_dir())

    def dump(self) -> dict[str, Any]:
        """Every value, secrets included: what a submitted job needs. Files and trackers get `public_dump`."""
        return self.model_dump(mode="json")

    def public_dump(self) -> dict[str, Any]:
        """`dump` with the value of every secret-named key (`*_key`, `*_token`, `*password*`, ...) redacted."""
        return redact(self.dump())

    def make_run_dir(self) -> Path:
        """The run's folder, created (with its parents) if need be, with `storage.mode`'s folder mode: set before
        any file of the run is written into it, whatever the umask."""
        folder = self.run_dir()
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, self.storage.folder_mode)
        return folder

    def seal_run_dir(self) -> None:
        """Give every file and folder of the run folder `storage.mode`'s modes (files written by other processes,
        a Ray worker's checkpoint, came with their own umask; the folder's mode kept them private meanwhile)."""
        folder = self.run_dir()
        if not folder.is_dir():
            return
        for path in [folder, *folder.rglob("*")]:
            if path.is_symlink():
                continue
            with contextlib.suppress(OSError):  # a file being replaced as we walk
                os.chmod(path, self.storage.folder_mode if path.is_dir() else self.storage.file_mode)

    def save(self, folder: str | Path) -> Path:
        """config.yaml and config.json (secrets redacted) into `folder`, with `storage.mode`'s file mode."""
        folder = Path(folder)
        if folder.resolve() == self.run_dir().resolve():
            self.make_run_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.yaml"
        for target, text in (
            (path, yaml.safe_dump(self.public_dump(), sort_keys=False)),
            (folder / "config.json", json.dumps(self.public_dump(), indent=2)),
        ):
            target.write_text(text)
            os.chmod(target, self.storage.file_mode)
        return path
