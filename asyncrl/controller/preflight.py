"""Pre-flight checks of a resolved config: what `asyncrl check` verifies before anything heavy starts.

The schema (`asyncrl.config`) already rejects wrong types, ranges and unknown keys; these checks look at the
world outside the config: the model folder (and, on vLLM's CPU build, whether its engines can serve the model's
head size and the run's dtype), the data files and their columns, the reward's import path, a
checkpoint to resume from, and whether the pools' resources fit the cluster (or this machine). Every problem
names the config key and the reason, and all problems are reported at once.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.cluster.calls import named_get
from asyncrl.config import Config
from asyncrl.remote import Store, is_remote, join

ROWS_CHECKED = 64
"""Rows of each Parquet file whose nested layout is checked (the schema is checked for the whole file), and rows
of the first file whose prompt lengths are."""


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
    unreadable: dict[str, list[str]] = field(default_factory=dict)
    """Path -> the nodes (id prefixes) that cannot use it (probed on a cluster; empty on this machine)."""
    probed: bool = False
    """Whether `unreadable` was probed on every node (a cluster); else the checks probe from this machine."""

    def total(self, resource: str) -> float:
        return sum(node.get(resource, 0.0) for node in self.nodes)

    def largest(self, resource: str) -> float:
        return max((node.get(resource, 0.0) for node in self.nodes), default=0.0)


def local_resources() -> Resources:
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    return Resources("this machine", [{"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}], cpus_oversubscribe=True)


def cluster_resources(address: str, paths: dict[str, str] | None = None, store: Store | None = None) -> Resources:
    """Alive nodes of the Ray cluster at `address` and which of them cannot use `paths` (config key -> path,
    `paths_every_node_reads`); connects as a driver and runs one tiny task per node, starts no actor."""
    import ray

    if address.startswith(("http://", "https://")):
        raise ConnectionError(
            f"check --address {address}: give the cluster address a driver connects to (host:6379, or auto on a node), "
            "not the dashboard URL"
        )
    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        unreadable = _probe_paths([n["NodeID"] for n in alive], paths or {}, store=store)
    finally:
        ray.shutdown()
    nodes = [dict(n["Resources"]) for n in alive]
    return Resources(f"the cluster at {address}", nodes, unreadable=unreadable, probed=True)


def _usable(paths: dict[str, str], store: Store | None) -> list[bool]:
    """Runs on each node: the model folder is readable; the storage folder is writable, or can be created; on an
    object store: a model's config.json can be read, and the run folder can be written (one try each)."""
    out = []
    for key, path in paths.items():
        if is_remote(path):
            out.append(_reachable(key, path, store or Store()) is None)
            continue
        if key != "storage.uri":
            out.append(os.access(path, os.R_OK))
            continue
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        out.append(os.access(existing, os.W_OK))
    return out


def _reachable(key: str, uri: str, store: Store) -> str | None:
    """Why this process cannot use the object-store URI `uri` (one try, no retries), or None."""
    if key == "storage.uri":
        return store.probe(uri)
    try:
        fs, path = store.filesystem(join(uri, "config.json"))
        return None if fs.exists(path, timeout=store.request_timeout_s) else f"{uri} has no config.json"
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        return f"{type(e).__name__}: {e}"


def _probe_paths(
    node_ids: list[str], paths: dict[str, str], timeout_s: float = 60.0, store: Store | None = None
) -> dict[str, list[str]]:
    """Path -> ids (8 characters) of the nodes where it cannot be used."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not paths:
        return {}
    probe = ray.remote(_usable)
    refs = [
        probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            paths, store
        )
        for n in node_ids
    ]
    unreadable: dict[str, list[str]] = {}
    answers = named_get(refs, timeout_s, f"path check on node(s) {', '.join(n[:8] for n in node_ids)}")
    for node, usable in zip(node_ids, answers, strict=True):
        for path, ok in zip(paths.values(), usable, strict=True):
            if not ok:
                unreadable.setdefault(path, []).append(node[:8])
    return unreadable


def paths_every_node_reads(cfg: Config) -> dict[str, str]:
    """Config key -> the path actors on any node open: the user's model folder and the shared storage."""
    paths = {
        "model.path": cfg.model.path,
        "learner.reference_path": cfg.learner.reference_path,
        "storage.uri": cfg.storage.uri
        and (cfg.run_uri() if is_remote(cfg.storage.uri) else cfg.storage.uri.removeprefix("file://")),
    }
    return {key: path for key, path in paths.items() if path}


def preflight(cfg: Config, resources: Resources | None = None, placement: bool = True) -> list[Problem]:
    """Every problem found, in config order; an empty list means the job can start. `placement=False` leaves
    the resources and shared paths to the cluster that runs the job (`asyncrl submit`)."""
    fetched, problems = _fetched_model(cfg)
    problems += [*_model(fetched), *_engine(fetched), *_data(fetched), *_reward(cfg), *_env(cfg), *_resume(cfg)]
    problems += [*_routing_replay(fetched), *_reference(fetched), *_rank_memory(fetched), *_megatron(fetched)]
    if placement:
        resources = resources or local_resources()
        problems += [*_placement(cfg, resources), *_storage(cfg, resources)]
    return problems


def _megatron(cfg: Config) -> list[Problem]:
    """`learner.training_backend` megatron: megatron-core is installed, the model's family has a converter
    (`asyncrl.learner.megatron.convert`) and `learner.tensor_parallel` divides its attention and key-value heads."""
    import importlib.util

    if cfg.learner.training_backend != "megatron":
        return []
    from asyncrl.learner.megatron.convert import CONVERTERS

    problems = []
    if importlib.util.find_spec("megatron.core") is None:
        problems.append(
            Problem("learner.training_backend", "megatron needs megatron-core: pip install 'asyncrl[megatron]'")
        )
    if is_remote(cfg.storage.uri):
        problems.append(Problem("storage.uri", "megatron checkpoints need a mounted folder, not an object store (yet)"))
    config = _model_shape(cfg)
    if config is None:
        return problems  # an unreadable model folder is reported by `_model`
    if config.get("model_type") not in CONVERTERS:
        problems.append(
            Problem(
                "learner.training_backend",
                f"megatron has no converter for model_type {config.get('model_type')!r} "
                f"(supported: {', '.join(CONVERTERS)})",
            )
        )
    tp = cfg.learner.tensor_parallel
    if config.get("num_experts") and tp > 1:
        problems.append(
            Problem("learner.tensor_parallel", f"{tp}: an MoE model trains with tensor_parallel = 1 on megatron")
        )
    heads = config.get("num_attention_heads") or 0
    for key, count in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", config.get("num_key_value_heads") or heads),
    ):
        if count % tp:
            problems.append(Problem("learner.tensor_parallel", f"{tp} does not divide the model's {key} ({count})"))
    return problems


def _model_shape(cfg: Config) -> dict | None:
    """The model's config.json fields: `model.path`'s file, or the preset's config; None when unreadable."""
    from asyncrl.models import PRESETS, qwen2_config

    if cfg.model.path is None:
        return qwen2_config(PRESETS[cfg.model.preset]).to_dict() if cfg.model.preset in PRESETS else None
    config = _config_json(cfg.model.path)
    return config if isinstance(config, dict) else None


def _fetched_model(cfg: Config) -> tuple[Config, list[Problem]]:
    """A `model.path` on an object store is fetched into this machine's cache (as the run does), and the checks of
    the model folder read that copy: -> (the config they check, a problem when it cannot be fetched)."""
    if not is_remote(cfg.model.path):
        return cfg, []
    from asyncrl.models.shipping import fetch

    try:
        local = fetch(str(cfg.model.path), cfg.storage.store())
    except (OSError, ValueError) as e:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": None})}), [
            Problem("model.path", f"cannot fetch {cfg.model.path}: {e}")
        ]
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(local)})}), []


def _rank_memory(cfg: Config) -> list[Problem]:
    """`learner.rank_memory_gb` holds each rank's train state at `learner.num_ranks` (a `model.path` folder; a preset
    is checked when the learner starts, once it is built)."""
    from asyncrl.learner.memory import check_rank_memory
    from asyncrl.learner.pool import recipe_from_config

    if cfg.learner.rank_memory_gb is None or not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return []
    if _reference(cfg):
        return []  # an unreadable reference is reported by `_reference`
    try:
        check_rank_memory(cfg.learner, cfg.model.path, recipe_from_config(cfg).needs_reference)
    except ValueError as e:
        return [Problem("learner.rank_memory_gb", str(e).removeprefix("learner.rank_memory_gb = "))]
    return []


def _storage(cfg: Config, resources: Resources) -> list[Problem]:
    """On a cluster, paths actors open must be readable on every node, and a multi-node run needs a shared
    run directory (learner rank 0 and the replay queue write into it from their own nodes): a mounted folder or
    an object store. Without a cluster to probe, an object store is probed from this machine."""
    problems = [
        Problem(
            key,
            f"{path} is not {'writable' if key == 'storage.uri' else 'readable'} "
            f"on node(s) {', '.join(resources.unreadable[path])} of {resources.where}",
        )
        for key, path in paths_every_node_reads(cfg).items()
        if path in resources.unreadable
    ]
    if not resources.probed:
        store = cfg.storage.store()
        for key, path in paths_every_node_reads(cfg).items():
            reason = _reachable(key, path, store) if is_remote(path) else None
            if reason is not None:
                verb = "written" if key == "storage.uri" else "read"
                problems.append(Problem(key, f"{path} cannot be {verb}: {reason}"))
    if len(resources.nodes) > 1 and cfg.storage.uri is None:
        problems.append(
            Problem(
                "storage.uri",
                f"{resources.where} has {len(resources.nodes)} nodes: set it to a folder every node mounts or an "
                "object store (s3://, gs://) every node reaches (checkpoints, final_model and trajectories are "
                "written on the nodes of the learner and the replay queue)",
            )
        )
    return problems


def _model(cfg: Config) -> list[Problem]:
    """The preset exists, or `model.path` is a Hugging Face folder of a supported architecture whose tokenizer has
    a chat template."""
    folder = _model_folder(cfg)
    if folder or cfg.model.path is None:
        return folder
    return _supported(Path(cfg.model.path), cfg.model.allow_untested_architecture)


def _supported(path: Path, allow_untested: bool = False) -> list[Problem]:
    """An architecture the learner and engines are tested with (`asyncrl.models.families`, docs/models.md), and a
    chat template (prompts are chat messages: Parquet rows, multi-turn environments, the OpenAI endpoint)."""
    from asyncrl.models.families import SUPPORTED_ARCHITECTURES
    from asyncrl.models.templates import has_chat_template

    problems = []
    config = _config_json(path)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(config, dict) and not (isinstance(architectures, list) and architectures):
        problems.append(Problem("model.path", f"{path / 'config.json'} names no architecture (`architectures`)"))
    elif isinstance(architectures, list) and architectures[0] not in SUPPORTED_ARCHITECTURES and not allow_untested:
        problems.append(
            Problem(
                "model.path",
                f"{path / 'config.json'}: architecture {architectures[0]} is not one asyncrl supports "
                f"({', '.join(SUPPORTED_ARCHITECTURES)}; docs/models.md says how to add a family, and "
                "model.allow_untested_architecture=true starts it anyway)",
            )
        )
    if not has_chat_template(path):
        problems.append(
            Problem(
                "model.path",
                f"{path} has a tokenizer without a chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json); add the model's chat format (docs/tokenizers.md)",
            )
        )
    return problems


def _config_json(folder: str | Path) -> object | None:
    """A model folder's parsed `config.json`, or None when it cannot be read as JSON (`_engine` names why)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _model_folder(cfg: Config) -> list[Problem]:
    """The preset exists, or `model.path` is a folder with a config.json and a tokenizer."""
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


def _engine(cfg: Config) -> list[Problem]:
    """What the engines' vLLM build cannot serve: on CPU, the model's head size and the run's dtype."""
    from asyncrl.rollout.vllm_compat.limits import cpu_dtypes, cpu_head_size_problem
    from asyncrl.rollout.vllm_compat.process import cpu_build

    if cfg.rollout.num_gpus_per_worker > 0 and not cpu_build():
        return []
    problems = []
    if cfg.model.dtype not in cpu_dtypes():
        problems.append(
            Problem("model.dtype", f"{cfg.model.dtype} is not a dtype vLLM's CPU build computes in on this machine")
        )
    if cfg.model.path is None and cfg.model.family is not None:
        return problems + _family_shape(cfg)
    if cfg.model.path is None or _model_folder(cfg):
        return problems  # presets keep head sizes the CPU build serves; a broken folder is reported by `_model`
    config_file = Path(cfg.model.path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        return [*problems, Problem("model.path", f"{config_file} is not readable JSON: {e}")]
    reason = cpu_head_size_problem(config) if isinstance(config, dict) else None
    if reason is not None:
        problems.append(
            Problem(
                "model.path",
                f"{config_file}: {reason}; use a model with a served head size, or engines on GPUs"
                " (rollout.num_gpus_per_worker)",
            )
        )
    return problems


def _family_shape(cfg: Config) -> list[Problem]:
    """A `model.family_shape` that cannot be built (`family_shape`) or whose head size the CPU build does not serve."""
    from asyncrl.models.families import family_shape
    from asyncrl.rollout.vllm_compat.limits import cpu_head_size_problem

    try:
        reason = cpu_head_size_problem(family_shape(cfg.model.family_shape.changes()))
    except ValueError as e:
        reason = str(e)
    return [] if reason is None else [Problem("model.family_shape", reason)]


def _routing_replay(cfg: Config) -> list[Problem]:
    """`learner.routing_replay` needs an MoE model and engines that return routed experts (`vllm_compat.routes`)."""
    from asyncrl.rollout.vllm_compat.routes import routes_problem

    if not cfg.learner.routing_replay:
        return []
    config: object = {"model_type": f"the preset {cfg.model.preset}"}  # the presets are dense Qwen2 models
    if cfg.model.path is not None:
        if _model_folder(cfg):
            return []  # reported by `_model`
        config = _config_json(cfg.model.path)
        if config is None:
            return []  # reported by `_engine`
    reason = routes_problem(config if isinstance(config, dict) else {})
    return [Problem("learner.routing_replay", reason)] if reason else []


def _reference(cfg: Config) -> list[Problem]:
    """`learner.reference_path` (the KL term's reference policy; unset = the starting weights) is a Hugging Face
    model folder whose vocabulary is the policy's (a `model.path` folder; a preset is built later)."""
    if cfg.learner.reference_path is None:
        return []
    path = Path(cfg.learner.reference_path)
    if not path.is_dir():
        return [Problem("learner.reference_path", f"{path} does not exist or is not a directory")]
    config = _config_json(path)
    if config is None:
        reason = f"{path} has no readable config.json (not a Hugging Face model folder)"
        return [Problem("learner.reference_path", reason)]
    policy = _config_json(cfg.model.path) if cfg.model.path else None
    vocab, policy_vocab = (c.get("vocab_size") if isinstance(c, dict) else None for c in (config, policy))
    if policy_vocab is not None and vocab != policy_vocab:
        return [
            Problem(
                "learner.reference_path",
                f"{path / 'config.json'}: vocab_size {vocab} is not the policy's ({policy_vocab}, model.path); "
                "the KL term compares the two models' log-probs of the same tokens",
            )
        ]
    return []


def _data(cfg: Config) -> list[Problem]:
    from asyncrl.envs.parquet import resolve_files

    if cfg.data.task != "parquet":
        return []
    if not cfg.data.train_path:
        return [Problem("data.train_path", "task 'parquet' needs a training file")]
    specs = {"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path}
    problems = []
    for key, spec in specs.items():
        if not spec:
            continue
        try:
            files = resolve_files(spec)
        except FileNotFoundError as e:
            problems.append(Problem(key, str(e)))
            continue
        found = [p for path in files for p in _parquet(key, path, alone=len(files) == 1)]
        problems += found or _ids(key, spec) or _prompt_lengths(cfg, key, files[0])
    return problems


def _ids(key: str, spec: str) -> list[Problem]:
    """Every prompt id is unique (the run builds the same index: ~1 s for a million rows)."""
    from asyncrl.envs.parquet import ParquetIndex

    try:
        ParquetIndex.build(spec)
    except (OSError, ValueError) as e:
        return [Problem(key, str(e))]
    return []


def _prompt_lengths(cfg: Config, key: str, path: str) -> list[Problem]:
    """Some of the first rows, as the run will tokenize them, are short enough to keep (`data.max_prompt_tokens`):
    the run skips longer prompts, and a dataset of only those would never give the engines a prompt."""
    import pyarrow.parquet as pq

    from asyncrl.envs.data import encode_messages, max_prompt_tokens

    tokenizer = _tokenizer(cfg)
    if tokenizer is None:
        return []  # the model itself is at fault, reported by `_model`
    limit = max_prompt_tokens(cfg)
    rows = next(pq.ParquetFile(path).iter_batches(batch_size=ROWS_CHECKED, columns=["prompt"]), None)
    if rows is None:
        return []  # an empty first file of several
    lengths = [len(encode_messages(tokenizer, prompt)) for prompt in rows.column("prompt").to_pylist()]
    if min(lengths) > limit:
        return [
            Problem(
                key,
                f"{path}: every one of the first {len(lengths)} prompts is longer than data.max_prompt_tokens "
                f"({limit} tokens; the shortest has {min(lengths)}): the run would skip them all",
            )
        ]
    return []


def _tokenizer(cfg: Config):
    """The run's tokenizer without building the model: a preset's character tokenizer, or the model folder's."""
    from asyncrl.models import PRESETS
    from asyncrl.models.tokenizer import build_char_tokenizer

    if cfg.model.path is None:
        return build_char_tokenizer(PRESETS[cfg.model.preset].alphabet) if cfg.model.preset in PRESETS else None
    if _model_folder(cfg):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.path)


def _parquet(key: str, path: str, alone: bool) -> list[Problem]:
    """The file's schema and first rows; an empty file is a problem when it is the dataset's only one."""
    from asyncrl.envs.data import check_verl_rows
    from asyncrl.envs.parquet import open_parquet

    try:
        file = open_parquet(path)
    except (OSError, ValueError) as e:
        return [Problem(key, str(e))]
    rows = next(file.iter_batches(batch_size=ROWS_CHECKED), None)
    if rows is None:
        return [Problem(key, f"{path} has no rows")] if alone else []
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


RUN_IDENTITY = ("model.path", "model.preset", "model.dtype", "learner.critic", "algorithm.preset", "mode")
"""What a checkpoint's run must share with the config resuming it (a different model or algorithm cannot load)."""


def _resume(cfg: Config) -> list[Problem]:
    where = cfg.checkpoint.resume_from
    if where is None or where == "latest":
        return []
    from asyncrl.learner.checkpoint import STATE_FILE, is_complete

    if is_remote(where):
        if is_complete(where, cfg.storage.store()):
            return []
        return [Problem("checkpoint.resume_from", f"{where} is not a complete checkpoint (no {STATE_FILE})")]

    folder = Path(where)
    if not (folder / STATE_FILE).is_file():
        return [Problem("checkpoint.resume_from", f"{where} is not a complete checkpoint (no {STATE_FILE})")]
    reason = _corrupt(folder) or _other_config(cfg, folder) or _other_backend(cfg, folder)
    return [Problem("checkpoint.resume_from", reason)] if reason else []


def _other_backend(cfg: Config, folder: Path) -> str | None:
    """A checkpoint of the other `learner.training_backend` resumes only once converted (`asyncrl.learner.megatron
    .switch`)."""
    from asyncrl.learner.megatron.switch import backend_of

    written, ours = backend_of(folder), cfg.learner.training_backend
    if written == ours:
        return None
    tp = f" --tensor-parallel {cfg.learner.tensor_parallel}" if ours == "megatron" else ""
    return (
        f"{folder} was written by learner.training_backend = {written}, this config has {ours}: convert it with "
        f"`asyncrl convert-checkpoint {folder} NEW_FOLDER --to {ours} --model MODEL_DIR{tp}` and resume from that"
    )


def _corrupt(folder: Path) -> str | None:
    """Why a checkpoint folder with its marker cannot be loaded (unreadable marker, missing shards)."""
    import json

    from asyncrl.learner.checkpoint import STATE_FILE

    try:
        state = json.loads((folder / STATE_FILE).read_text())
        ints = all(isinstance(state[k], int) for k in ("step", "version", "num_ranks"))
    except (ValueError, KeyError, TypeError) as e:
        return f"{folder / STATE_FILE} is corrupt ({type(e).__name__}: {e})"
    if not ints:
        return f"{folder / STATE_FILE} is corrupt: step, version and num_ranks must be integers (got {state})"
    # The FSDP2 backend's DCP index, or the megatron backend's first TP piece (`asyncrl.learner.megatron.state`).
    shards = "learner/megatron_tp0.pt" if (folder / "learner/megatron_tp0.pt").is_file() else "learner/.metadata"
    missing = [name for name in (shards, "learner/rank_0.pt") if not (folder / name).is_file()]
    return f"{folder} is corrupt: {', '.join(missing)} missing" if missing else None


def _other_config(cfg: Config, folder: Path) -> str | None:
    """The checkpoint's run folder (`<run>/checkpoints/step-N`) keeps the config that wrote it."""
    import yaml

    saved_file = folder.parent.parent / "config.yaml"
    if not saved_file.is_file():
        return None
    saved, ours = yaml.safe_load(saved_file.read_text()) or {}, cfg.public_dump()
    for key in RUN_IDENTITY:
        section, name = key.split(".") if "." in key else (None, key)
        theirs, mine = (
            ((saved.get(section) or {}).get(name), ours[section][name]) if section else (saved.get(name), ours[name])
        )
        if theirs != mine:
            return f"{folder} was written by a run with {key} = {theirs!r}; this config has {mine!r} ({saved_file})"
    return None


def _placement(cfg: Config, resources: Resources) -> list[Problem]:
    """Each pool's unit (its placement bundle) must fit on one node, and both pools together in the whole
    cluster; custom resources (`rollout.resources`, `learner.resources`) are checked like CPU and GPU."""
    from asyncrl.cluster.placement import bundle

    pools = {
        "rollout_pool": (
            cfg.rollout.num_workers,
            bundle(cfg.rollout.num_cpus_per_worker, cfg.rollout.num_gpus_per_worker, cfg.rollout.resources),
        ),
        "learner_pool": (
            cfg.learner.num_ranks,
            bundle(cfg.learner.num_cpus_per_rank, cfg.learner.num_gpus_per_rank, cfg.learner.resources),
        ),
    }
    problems = []
    for resource in ["CPU", "GPU", *sorted({k for _, unit in pools.values() for k in unit} - {"CPU", "GPU"})]:
        if resource == "CPU" and resources.cpus_oversubscribe:
            continue
        for pool, (_count, unit) in pools.items():
            if unit.get(resource, 0.0) > resources.largest(resource):
                problems.append(
                    Problem(
                        pool,
                        f"one unit needs {unit[resource]:g} {resource}; "
                        f"the largest node of {resources.where} has {resources.largest(resource):g}",
                    )
                )
        need = {pool: count * unit.get(resource, 0.0) for pool, (count, unit) in pools.items()}
        if sum(need.values()) > resources.total(resource):
            parts = " + ".join(f"{pool} {amount:g}" for pool, amount in need.items())
            short = max(need, key=lambda pool: need[pool])
            problems.append(
                Problem(
                    short,
                    f"the pools need {sum(need.values()):g} {resource} ({parts}); "
                    f"{resources.where} has {resources.total(resource):g}",
                )
            )
    return problems
