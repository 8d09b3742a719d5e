"""Entry point of a run: resolve the model, build the pools, run the mode's loop, write summary.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from asyncrl.config import Config


def run(cfg: Config) -> dict:
    """Run one job end to end and return (and write) its summary."""
    from asyncrl.controller.loop import Controller
    from asyncrl.models import ensure_model

    out = Path(cfg.output_dir)
    cfg.save(out)
    model_dir = ensure_model(cfg)
    _init_ray(cfg)
    controller = Controller(cfg, model_dir)
    try:
        controller.start()
        summary = controller.run()
    finally:
        controller.shutdown()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    # Locally, Ray's CPU count is a scheduling label, not a thread limit: ask for what the pools need.
    need = cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker + cfg.learner.num_ranks * cfg.learner.num_cpus_per_rank
    ray.init(num_cpus=max(int(need) + 2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
