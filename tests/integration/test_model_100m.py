"""A ~100M-parameter model end to end: a Qwen2 of hidden 512, 8 layers, 8 query heads of 64 (2 KV heads),
intermediate 2048, tied embeddings, random init, with the production byte-level BPE vocabulary (131,075 ids,
`asyncrl.models.bpe.production_tokenizer`, ChatML), built with `save_pretrained` (benchmarks/model_scale.py's
builder, which also builds the 0.5B shape). One step of a real run from `model.path` on verl Parquet: Ray, one
vLLM CPU engine, one FSDP2 learner rank, a weight sync and a parity probe after it (repeated steps and syncs are
the tiny models' tests: this one is about the size).

Parameters: embedding 131,075 x 512 = 67,110,400 (tied: the head is the same matrix); per layer q 512x512+512,
k and v 512x128+128 each, o 512x512, MLP 3 x 512x2048, two norms of 512: 3,802,880; 8 layers 30,423,040;
final norm 512. Total 97,533,952.
"""

import json
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.integration
STEPS = 1
PROMPTS_PER_STEP = 2
SAMPLES_PER_PROMPT = 2


@pytest.fixture(scope="module")
def model_100m(tmp_path_factory):
    from model_scale import Shape, build_checkpoint

    out = tmp_path_factory.mktemp("model-100m") / "model"
    build_checkpoint(out, Shape(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2048))
    return out


def _config(tmp_path, model_dir):
    from model_scale import write_prompts

    write_prompts(tmp_path / "train.parquet", 16)
    overrides = {
        "mode": "streaming", "output_dir": str(tmp_path / "run"), "model.path": str(model_dir),
        "data.task": "parquet", "data.train_path": str(tmp_path / "train.parquet"),
        "rollout.samples_per_prompt": SAMPLES_PER_PROMPT, "rollout.max_tokens": 8, "rollout.max_model_len": 128,
        "learner.num_ranks": 1, "learner.prompts_per_step": PROMPTS_PER_STEP, "learner.max_steps": STEPS,
        "buffer.max_staleness": 1, "buffer.filter_zero_variance": False, "eval.every_steps": 0,
        "weight_sync.parity_probe_every": 1, "telemetry.progress": False, "telemetry.dashboard_port": 0,
        "checkpoint.export_hf": False,
    }  # fmt: skip
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def test_a_100m_bpe_model_trains_syncs_and_keeps_parity(ray_cluster, model_100m, tmp_path):
    from model_scale import num_parameters

    from asyncrl.controller.loop import Controller

    assert num_parameters(model_100m) == 97_533_952  # the module docstring's sum
    assert json.loads((model_100m / "config.json").read_text())["vocab_size"] == 131_075
    controller = Controller(_config(tmp_path, model_100m), model_100m)
    try:
        controller.start()
        summary = controller.run()
        history = controller.records.history
    finally:
        controller.shutdown()
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert summary["samples_trained"] == STEPS * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    assert [e["version"] for e in summary["rollout"].values()] == [STEPS]  # the engine serves the last sync's weights
    assert all(row["sync_bytes"] >= 4 * 97_533_952 for row in history)  # every step's weights went out, fp32
    parities = [row["parity_max_abs_diff"] for row in history]
    assert len(parities) == STEPS and max(parities) <= 1e-5  # fp32 on both sides
