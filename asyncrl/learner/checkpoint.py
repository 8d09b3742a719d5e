"""Learner checkpoints and Hugging Face export.

Layout of a checkpoint folder (written by `LearnerPool.save_checkpoint`):

    learner/            torch.distributed.checkpoint (DCP) shards: policy model + optimizer (+ critic)
    learner/rank_<r>.pt per-rank RNG states and LR-scheduler states
    extra.json          the controller's own state (queue state, counters), passed through untouched
    learner_state.json  step, policy version, number of ranks; written LAST, so its presence marks a
                        complete checkpoint

DCP stores sharded tensors with their global layout, so a checkpoint loads into a pool with another
number of ranks (RNG states are then restored only for the ranks that existed). All ranks write into
the same folder: on several nodes a shared file system, or an object store (`s3://`, `gs://`): there each
rank writes its own files into a node-local staging folder and uploads them (`asyncrl.remote`), the driver
uploads `extra.json` and then the marker, and a loading rank downloads the shards first.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from asyncrl.remote import Store, is_remote, join, staging

__all__ = [
    "STATE_FILE",
    "TrainState",
    "copy_tokenizer_files",
    "is_complete",
    "load_train_state",
    "read_learner_state",
    "save_train_state",
    "write_learner_state",
]

STATE_FILE = "learner_state.json"
EXTRA_FILE = "extra.json"
_DCP_DIR = "learner"


@dataclass
class TrainState:
    """What one rank checkpoints. `critic*` are None without a critic."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def _sharded_state(state: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.policy, state.optimizer)
    out = {"policy": {"model": model_sd, "optim": optim_sd}}
    if state.critic is not None:
        assert state.critic_optimizer is not None  # a critic always comes with its optimizer (build_train_state)
        critic_sd, critic_optim_sd = get_state_dict(state.critic, state.critic_optimizer)
        out["critic"] = {"model": critic_sd, "optim": critic_optim_sd}
    return out


def _rng_state() -> dict[str, Any]:
    """Tensors, numbers and strings only, so that `torch.load(weights_only=True)` reads it back."""
    # The legacy form: a tuple for numpy's global generator, which is always MT19937.
    name, keys, *rest = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    out = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_train_state(folder: str | Path, state: TrainState, rank: int, step: int, store: Store | None = None) -> None:
    """Collective: every rank calls it. Writes the DCP shards and this rank's RNG/scheduler file; into an object
    store (`folder` a URI), each rank writes its own files in a staging folder of its own and uploads them (DCP's
    metadata names the shard files relative to the folder, so they meet in one remote folder)."""
    import torch.distributed.checkpoint as dcp

    remote = is_remote(folder)
    root = staging(str(folder)).with_name(f"{staging(str(folder)).name}.rank-{rank}") if remote else Path(folder)
    path = root / _DCP_DIR
    if remote:
        shutil.rmtree(root, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(state), checkpoint_id=str(path))
    local = {"rng": _rng_state(), "scheduler": state.scheduler.state_dict(), "step": step}
    if state.critic_scheduler is not None:
        local["critic_scheduler"] = state.critic_scheduler.state_dict()
    torch.save(local, path / f"rank_{rank}.pt")
    if remote:
        (store or Store()).upload(path, join(str(folder), _DCP_DIR))
        shutil.rmtree(root)  # kept when the upload failed: it names this folder


def load_train_state(folder: str | Path, state: TrainState, rank: int, store: Store | None = None) -> int:
    """Collective: load model, optimizer, schedulers and RNG into `state`; returns the saved step. From an object
    store each rank first downloads the shards into a staging folder of its own."""
    if not is_remote(folder):
        return _load_train_state(Path(folder) / _DCP_DIR, state, rank)
    local = staging(str(folder)).with_name(f"{staging(str(folder)).name}.load-{rank}")
    (store or Store()).download(join(str(folder), _DCP_DIR), local)
    try:
        return _load_train_state(local, state, rank)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _load_train_state(path: Path, state: TrainState, rank: int) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sharded = _sharded_state(state)
    dcp.load(sharded, checkpoint_id=str(path))
    set_state_dict(
        state.policy,
        state.optimizer,
        model_state_dict=sharded["policy"]["model"],
        optim_state_dict=sharded["policy"]["optim"],
    )
    if state.critic is not None:
        assert state.critic_optimizer is not None  # a critic always comes with its optimizer (build_train_state)
        set_state_dict(
            state.critic,
            state.critic_optimizer,
            model_state_dict=sharded["critic"]["model"],
            optim_state_dict=sharded["critic"]["optim"],
        )
    local_file = path / f"rank_{rank}.pt"
    # More ranks than at save time: schedulers are identical on all ranks, RNG stays as seeded.
    restore_rng = local_file.exists()
    local = torch.load(
        local_file if restore_rng else path / "rank_0.pt", weights_only=True
    )  # nothing unpickled from a user path
    state.scheduler.load_state_dict(local["scheduler"])
    if state.critic_scheduler is not None and "critic_scheduler" in local:
        state.critic_scheduler.load_state_dict(local["critic_scheduler"])
    if restore_rng:
        _set_rng_state(local["rng"])
    return int(local["step"])


def write_learner_state(
    folder: str | os.PathLike[str],
    *,
    step: int,
    version: int,
    num_ranks: int,
    extra: dict[str, Any],
    store: Store | None = None,
) -> None:
    """Driver side, after every rank saved: the controller's extra state, then the completion marker (into an
    object store: uploaded in that order)."""
    state = {"step": step, "version": version, "num_ranks": num_ranks}
    if is_remote(folder):
        store = store or Store()
        store.write_text(join(str(folder), EXTRA_FILE), json.dumps(extra, indent=2, sort_keys=True))
        store.write_text(join(str(folder), STATE_FILE), json.dumps(state, indent=2))
        return
    folder = Path(folder)
    (folder / EXTRA_FILE).write_text(json.dumps(extra, indent=2, sort_keys=True))
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.rename(folder / STATE_FILE)


def is_complete(folder: str | os.PathLike[str], store: Store | None = None) -> bool:
    if is_remote(folder):
        return (store or Store()).exists(join(str(folder), STATE_FILE))
    return (Path(folder) / STATE_FILE).exists()


def read_learner_state(
    folder: str | os.PathLike[str], store: Store | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (learner state {step, version, num_ranks}, extra). Raises if the checkpoint is incomplete."""
    if not is_complete(folder, store):
        raise FileNotFoundError(f"{folder} is not a complete learner checkpoint (no {STATE_FILE})")
    if is_remote(folder):
        store = store or Store()
        state = json.loads(store.read_text(join(str(folder), STATE_FILE)))
        try:
            return state, json.loads(store.read_text(join(str(folder), EXTRA_FILE)))
        except FileNotFoundError:
            return state, {}
    folder = Path(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    extra_path = folder / EXTRA_FILE
    extra = json.loads(extra_path.read_text()) if extra_path.exists() else {}
    return state, extra


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def copy_tokenizer_files(model_dir: str | Path, out_dir: str | Path) -> None:
    """Copy every non-weight file of the source model folder (tokenizer, generation config, ...); not asyncrl's
    own markers (`.asyncrl*`: where a fetched model came from)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in Path(model_dir).iterdir():
        if src.name.startswith(".asyncrl"):
            continue
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES) and not src.name.endswith(".index.json"):
            shutil.copy2(src, out_dir / src.name)
