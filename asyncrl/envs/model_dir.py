"""The model directory a run starts from: the user's `model.path` as is (fetched into the cache when it is on an
object store), or a preset built and, for the built-in `add`, `calc` and `word_problems` tasks, supervised
warm-started (`asyncrl.envs.warm_start`) once and cached under
$ASYNCRL_CACHE. The cache key is the warm start's whole specification, so a changed setting builds anew.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from asyncrl.models import PRESETS, build_model, cache_root, file_lock
from asyncrl.models.tokenizer import refresh_saved_tokenizer
from asyncrl.remote import is_remote

WARM_STARTED_TASKS = ("add", "calc", "word_problems")
"""Built-in tasks with a supervised warm start (`add`: `warm_start`; the agent tasks: `warm_start_calc`)."""
AGENT_TASKS = ("calc", "word_problems")


def ensure_model(cfg, report: Callable[[str], None] | None = None) -> Path:
    """The model directory for a config: `model.path`, or a cached (warm-started) preset. `report` is told what
    it does (a first warm start takes minutes, and a user should see it progress)."""
    report = report or (lambda _text: None)
    if is_remote(cfg.model.path):
        from asyncrl.models.shipping import fetch

        report(f"fetching model {cfg.model.path} (once per node)")
        return fetch(cfg.model.path, cfg.storage.store())
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} has no config.json (not a Hugging Face model folder)")
        return path
    if cfg.model.family:
        return _family_model(cfg, report)
    spec = {
        "preset": cfg.model.preset,
        "examples": cfg.model.warm_start_examples if cfg.data.task in WARM_STARTED_TASKS else 0,
        "epochs": cfg.model.warm_start_epochs,
        "lr": cfg.model.warm_start_lr,
        "max_operand": cfg.data.max_operand,
        "target": cfg.model.warm_start_target,
        "seed": cfg.seed,
        "v": 3,  # 3: deterministic (one thread), sampled reward and entropy recorded
    }
    if cfg.data.task in AGENT_TASKS:  # keys only the agent tasks have: the `add` starts keep their cache names
        spec.update(task=cfg.data.task, operands=cfg.data.operands, tool_fraction=cfg.model.warm_start_tool_fraction)
    elif cfg.model.warm_start_dropout > 0:
        spec["dropout"] = cfg.model.warm_start_dropout

    def build(tmp: Path) -> dict:
        report(f"building model {cfg.model.preset} in {tmp.with_suffix('')}")
        build_model(cfg.model.preset, tmp, seed=cfg.seed)
        record = {"spec": spec, "heldout_accuracy": None}
        if spec["examples"] > 0 and spec["epochs"] > 0:
            record.update(_warm_start(cfg, spec, tmp, report))
        return record

    def refresh(path: Path) -> None:
        refresh_saved_tokenizer(path, PRESETS[cfg.model.preset].alphabet)

    return _cached(cfg.model.preset, spec, build, report, refresh)


def _cached(
    name: str,
    spec: dict,
    build: Callable[[Path], dict],
    report: Callable[[str], None],
    refresh: Callable[[Path], None] | None = None,
) -> Path:
    """The cached model folder `<name>-<hash of spec>` under $ASYNCRL_CACHE: `build(tmp)` fills a fresh folder and
    returns its record (`warm_start.json`), once per specification (under a file lock; a folder without its record
    is built again); `refresh` is run on a cached one."""
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_root() / "models" / f"{name}-{key}"
    with file_lock(path.with_suffix(".lock")):
        if (path / "warm_start.json").exists():
            if refresh is not None:
                refresh(path)
            report(f"model: {path} (cached)")
            return path
        tmp = path.with_name(path.name + ".tmp")
        record = build(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(record, indent=2))
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return path


def _warm_start(cfg, spec: dict, model_dir: Path, report: Callable[[str], None]) -> dict:
    """The supervised warm start of the config's task, in place; returns what it measured. `report` is told its
    progress."""
    from asyncrl.envs import warm_start as ws

    if cfg.data.task in AGENT_TASKS:
        return ws.warm_start_calc(
            model_dir,
            spec["examples"],
            spec["epochs"],
            spec["lr"],
            spec["operands"],
            cfg.seed,
            spec["tool_fraction"],
            task=cfg.data.task,
        )
    measured = ws.warm_start(
        model_dir,
        spec["examples"],
        spec["epochs"],
        spec["lr"],
        spec["max_operand"],
        target=spec["target"],
        seed=cfg.seed,
        dropout=spec.get("dropout", 0.0),
        report=report,
    )
    if not measured["target_reached"]:
        import warnings

        warnings.warn(
            f"warm start of {cfg.model.preset} stopped after {spec['epochs']} epochs at validation accuracy "
            f"{measured['validation_accuracy']} < model.warm_start_target {spec['target']}",
            stacklevel=3,
        )
    return measured


def _family_model(cfg, report: Callable[[str], None]) -> Path:
    """A tiny `model.family` checkpoint with its BPE tokenizer, warm-started on tool-calling chat for the agent tasks
    (`warm_start_chat_calc`), built once per specification and cached."""
    from asyncrl.models.families import build_family

    chat = cfg.data.task in AGENT_TASKS and cfg.model.warm_start_examples > 0 and cfg.model.warm_start_epochs > 0
    spec: dict = {"family": cfg.model.family, "seed": cfg.seed, "v": 1}
    shape = cfg.model.family_shape.changes()
    if shape:  # a changed shape is its own model; the shared shape keeps its cache names
        spec["shape"] = shape
    if chat:
        spec.update(
            task=cfg.data.task,
            format="chat",
            examples=cfg.model.warm_start_examples,
            epochs=cfg.model.warm_start_epochs,
            lr=cfg.model.warm_start_lr,
            operands=cfg.data.operands,
            tool_fraction=cfg.model.warm_start_tool_fraction,
        )
        if cfg.model.warm_start_chat_target is not None:  # unset keeps the cache names of starts built before it
            spec["target"] = cfg.model.warm_start_chat_target

    def build(tmp: Path) -> dict:
        report(f"building model family {cfg.model.family} in {tmp.with_suffix('')}")
        build_family(cfg.model.family, tmp, seed=cfg.seed, shape=shape)
        record: dict = {"spec": spec}
        if chat:
            from asyncrl.envs.warm_start import warm_start_chat_calc

            report(f"warm start: {spec['examples']} tool-calling conversations x {spec['epochs']} epochs")
            args = (spec["examples"], spec["epochs"], spec["lr"], spec["operands"], cfg.seed, spec["tool_fraction"])
            record.update(warm_start_chat_calc(tmp, *args, target=spec.get("target"), report=report, task=spec["task"]))
        return record

    return _cached(cfg.model.family, spec, build, report)
