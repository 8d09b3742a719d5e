"""Entry point of a run: resolve the model, write the resolved config, run the mode, write summary.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

from asyncrl.config import Config


def run(cfg: Config) -> dict:
    out = Path(cfg.output_dir)
    cfg.save(out)
    start = time.perf_counter()
    from asyncrl.models import ensure_model

    model_dir = ensure_model(cfg)
    warm = json.loads((model_dir / "warm_start.json").read_text()) if (model_dir / "warm_start.json").exists() else {}
    summary = {
        "mode": cfg.mode,
        "model_dir": str(model_dir),
        "start_accuracy": warm.get("heldout_accuracy"),
        "wall_clock_s": round(time.perf_counter() - start, 2),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
