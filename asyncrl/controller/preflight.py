"""Pre-flight checks of a resolved config: what `asyncrl check` verifies before anything heavy starts.

The schema (`asyncrl.config`) already rejects wrong types, ranges and unknown keys; these checks look at the
world outside the config: the model folder, the data files and their columns, the reward's import path, a
checkpoint to resume from, and whether the pools' resources fit the cluster (or this machine). Every problem
names the config key and the reason, and all problems are reported at once.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import Config

VERL_COLUMNS = ("data_source", "prompt", "reward_model")
ROWS_CHECKED = 64
"""Rows of each Parquet file whose nested layout is checked (the schema is checked for the whole file)."""


@dataclass(frozen=True)
class Problem:
    key: str
    """The config key at fault (`model.path`, `data.train_path`, `rollout_pool`, ...)."""
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass
class Resources:
    """What the pools can be placed on: one dict of resource -> amount per node."""

    where: str
    nodes: list[dict[str, float]] = field(default_factory=list)
    cpus_oversubscribe: bool = False
    """Local runs start Ray with as many CPU slots as the pools ask for (CPU is a scheduling label there)."""

    def total(self, resource: str) -> float:
        return sum(node.get(resource, 0.0) for node in self.nodes)

    def largest(self, resource: str) -> float:
        return max((node.get(resource, 0.0) for node in self.nodes), default=0.0)


def local_resources() -> Resources:
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    return Resources("this machine", [{"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}], cpus_oversubscribe=True)


def cluster_resources(address: str) -> Resources:
    """Alive nodes of the Ray cluster at `address` (connects as a driver, starts nothing)."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()
    return Resources(f"the cluster at {address}", nodes)


def preflight(cfg: Config, resources: Resources | None = None) -> list[Problem]:
    """Every problem found, in config order; an empty list means the job can start."""
    resources = resources or local_resources()
    return [*_model(cfg), *_data(cfg), *_reward(cfg), *_env(cfg), *_resume(cfg), *_placement(cfg, resources)]


def _model(cfg: Config) -> list[Problem]:
    from asyncrl.models import PRESETS

    if cfg.model.path is None:
        if cfg.model.preset not in PRESETS:
            return [Problem("model.preset", f"unknown preset {cfg.model.preset!r}; valid: {', '.join(PRESETS)}")]
        return []
    path = Path(cfg.model.path)
    if not path.is_dir():
        return [Problem("model.path", f"{path} does not exist or is not a directory")]
    if not (path / "config.json").is_file():
        return [Problem("model.path", f"{path} has no config.json (not a Hugging Face model folder)")]
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return [Problem("model.path", f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")]
    return []


def _data(cfg: Config) -> list[Problem]:
    if cfg.data.task != "parquet":
        return []
    if not cfg.data.train_path:
        return [Problem("data.train_path", "task 'parquet' needs a training file")]
    problems = _parquet("data.train_path", cfg.data.train_path)
    if cfg.data.eval_path:
        problems += _parquet("data.eval_path", cfg.data.eval_path)
    return problems


def _parquet(key: str, path: str) -> list[Problem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.envs.data import check_verl_rows

    try:
        file = pq.ParquetFile(path)
    except FileNotFoundError:
        return [Problem(key, f"{path} does not exist")]
    except (OSError, pa.ArrowException) as e:
        return [Problem(key, f"{path} is not a readable Parquet file: {e}")]
    missing = [c for c in VERL_COLUMNS if c not in file.schema_arrow.names]
    if missing:
        return [Problem(key, f"{path} lacks the verl columns {missing} (has {file.schema_arrow.names})")]
    rows = next(file.iter_batches(batch_size=ROWS_CHECKED), None)
    if rows is None:
        return [Problem(key, f"{path} has no rows")]
    try:
        check_verl_rows(rows.to_pylist(), path)
    except ValueError as e:
        return [Problem(key, str(e))]
    return []


def _reward(cfg: Config) -> list[Problem]:
    from asyncrl.envs.rewards import resolve_reward

    try:
        resolve_reward(cfg.env.reward)
    except ValueError as e:
        return [Problem("env.reward", str(e))]
    except Exception as e:  # the user's module raised while importing
        return [Problem("env.reward", f"importing {cfg.env.reward!r} raised {type(e).__name__}: {e}")]
    return []


def _env(cfg: Config) -> list[Problem]:
    """The environment imports, is a class with async `reset`/`step`, takes `env.kwargs` and has valid `stop`."""
    from asyncrl.envs.base import EnvContext, make_env, resolve_env

    try:
        resolve_env(cfg.env.name)
    except ValueError as e:
        return [Problem("env.name", str(e))]
    except Exception as e:  # the user's module raised while importing
        return [Problem("env.name", f"importing {cfg.env.name!r} raised {type(e).__name__}: {e}")]
    try:
        make_env(cfg.env.name, cfg.env.kwargs, EnvContext(reward=cfg.env.reward))
    except Exception as e:
        return [Problem("env.kwargs", str(e))]
    return []


def _resume(cfg: Config) -> list[Problem]:
    where = cfg.checkpoint.resume_from
    if where is None or where == "latest":
        return []
    from asyncrl.learner.checkpoint import STATE_FILE

    if not (Path(where) / STATE_FILE).is_file():
        return [Problem("checkpoint.resume_from", f"{where} is not a complete checkpoint (no {STATE_FILE})")]
    return []


def _placement(cfg: Config, resources: Resources) -> list[Problem]:
    """Each pool's unit must fit on one node, and both pools together in the whole cluster."""
    pools = {
        "rollout_pool": (cfg.rollout.num_workers, {"CPU": cfg.rollout.num_cpus_per_worker, "GPU": cfg.rollout.num_gpus_per_worker}),
        "learner_pool": (cfg.learner.num_ranks, {"CPU": cfg.learner.num_cpus_per_rank, "GPU": cfg.learner.num_gpus_per_rank}),
    }
    problems = []
    for resource in ("CPU", "GPU"):
        if resource == "CPU" and resources.cpus_oversubscribe:
            continue
        for pool, (count, unit) in pools.items():
            if unit[resource] > resources.largest(resource):
                problems.append(Problem(pool, f"one unit needs {unit[resource]:g} {resource}; the largest node of {resources.where} has {resources.largest(resource):g}"))
        need = {pool: count * unit[resource] for pool, (count, unit) in pools.items()}
        if sum(need.values()) > resources.total(resource):
            parts = " + ".join(f"{pool} {amount:g}" for pool, amount in need.items())
            short = max(need, key=need.get)
            problems.append(Problem(short, f"the pools need {sum(need.values()):g} {resource} ({parts}); {resources.where} has {resources.total(resource):g}"))
    return problems
