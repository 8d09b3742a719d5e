"""Golden run: a tiny deterministic on-policy (sync-style) training run whose per-step losses are committed.

Fixed groups (seeded random token sequences and rewards) go through the real learner pool (Ray actor,
FSDP2, batch building, recipe, AdamW) for a few steps; each step's loss depends on every earlier update,
so any silent change in the math (advantages, surrogate, reduction, optimizer, log-prob recompute) moves
the numbers. Regenerate deliberately with ASYNCRL_UPDATE_GOLDEN=1 and explain the change in the commit.
"""

import json
import os
from pathlib import Path

import pytest

from tests.unit.learner.helpers import random_groups

GOLDEN = Path(__file__).parent.parent / "assets" / "golden_sync_run.json"
RECIPES = {"grpo": {"correction": "tis"}}
STEPS = 4


def _run(model_dir, preset, overrides):
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.pool import LearnerPool

    recipe = resolve_recipe(preset, **overrides)
    pool = LearnerPool(model_dir, LearnerConfig(lr=1e-3, num_ranks=1, tokens_per_microbatch=64, seed=0), recipe)
    try:
        rows = []
        for step in range(STEPS):
            stats = pool.train_step(random_groups(num_groups=4, group_size=4, seed=100 + step))
            rows.append({"loss": stats.loss, "grad_norm": stats.grad_norm})
        return rows
    finally:
        pool.shutdown()


@pytest.mark.integration
def test_golden_run_losses_are_unchanged(ray_cluster, tiny_model_dir):
    got = {name: _run(tiny_model_dir, name, overrides) for name, overrides in RECIPES.items()}
    if os.environ.get("ASYNCRL_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=2) + "\n")
    expected = json.loads(GOLDEN.read_text())
    for name in RECIPES:
        for step, (g, e) in enumerate(zip(got[name], expected[name], strict=True)):
            assert g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6), f"{name} step {step}"
            assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5, abs=1e-7), f"{name} step {step}"
    # The run must actually train: the gradient norm changes from step to step.
    assert len({round(r["grad_norm"], 4) for r in got["grpo"]}) == STEPS
