"""`learner.lora` end to end on real Ray, a real FSDP2 (gloo) learner rank and a real vLLM CPU engine serving the
tiny model with vLLM's LoRA, all shared by the module: version 0 is the base model on both sides; after a step
only the adapter travels (`AdapterSync`) and the engine scores as the learner; an update in flight relabels the
running requests' later tokens; the exported PEFT adapter folder loads in vLLM and the merged model in transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from asyncrl.algo.sampling import RAW
from asyncrl.config import LoraConfig, WeightSyncConfig
from tests.integration.weight_sync_checks import PARITY_ATOL, PROBE, PROMPT_LEN, parity

pytestmark = pytest.mark.integration

os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
)

LORA = LoraConfig(rank=4, alpha=8.0)
NUM_ADAPTER_TENSORS = 2 * 7 * 4  # A and B of 7 projections in 4 layers
FULL_MODEL_BYTES = 270_400 * 4  # tiny-0.3m's parameters in fp32


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_model_dir):
    """(learner, rollout, adapter sync): one LoRA learner rank, one engine serving the adapter."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import EnvConfig, LearnerConfig, RolloutConfig
    from asyncrl.learner.pool import LearnerPool
    from asyncrl.rollout.pool import RolloutPool
    from asyncrl.weight_sync.adapter import AdapterSync

    learner = LearnerPool(tiny_model_dir, LearnerConfig(num_ranks=1, lr=1e-2, lora=LORA), resolve_recipe("grpo"))
    made: list = []
    rollout = RolloutPool(
        str(tiny_model_dir), RolloutConfig(num_workers=1), EnvConfig(), queue=None, dtype="float32",
        max_model_len=64, latest=lambda: made[0].latest(), lora_rank=LORA.rank,
    )  # fmt: skip
    made.append(AdapterSync(learner, rollout, WeightSyncConfig(timeout_s=60.0), "streaming"))
    try:
        rollout.start()
        yield learner, rollout, made[0]
    finally:
        rollout.shutdown()
        learner.shutdown()


def test_only_the_adapter_travels_and_the_engine_then_scores_as_the_learner(pools):
    import ray
    from safetensors.torch import load

    from asyncrl.testing import random_groups

    learner, rollout, sync = pools
    assert parity(pools) <= PARITY_ATOL  # version 0: B = 0 on the learner, the base model on the engine
    learner.train_step(random_groups(seed=1))
    before = parity(pools)
    result = sync.finish(sync.start(1))
    after = parity(pools)
    print(f"parity before {before:.2e}, after {after:.2e}; {result.num_bytes} bytes in {result.seconds:.3f} s")
    assert before > 1e-4 and after <= PARITY_ATOL
    assert rollout.versions() == {name: 1 for name in rollout.names}
    record = ray.get(sync.latest().refs[0])
    tensors = load(record.data)
    assert result.num_tensors == len(tensors) == NUM_ADAPTER_TENSORS
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    assert raw <= result.num_bytes <= raw + 16_384 and result.num_bytes < FULL_MODEL_BYTES / 8
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)


def test_an_update_in_flight_relabels_the_running_requests_later_tokens(pools):
    import ray

    from asyncrl.testing import random_groups

    learner, rollout, sync = pools
    worker = rollout.handle(rollout.names[0])
    learner.train_step(random_groups(seed=2))
    prompts = [[1, 4, 9, 14], [5, 15, 7], [3, 12], [6, 11, 8]]
    running = worker.evaluate.remote(prompts, 56, 1.0, 4)
    result = sync.finish(sync.start(2))
    spans = [r.versions for r in ray.get(running)]
    assert result.version == 2 and set().union(*spans) <= {1, 2}
    assert any(v == {1, 2} for v in spans), spans  # a request straddled the update
    assert parity(pools) <= PARITY_ATOL


def test_the_exported_adapter_loads_in_vllm_and_the_merged_model_in_transformers(pools, tmp_path):
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.weights.adapter import AdapterWeights

    learner, rollout, _ = pools
    learner.export_hf(tmp_path)
    adapter = tmp_path / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == LORA.rank and config["peft_type"] == "LORA"
    record = AdapterWeights((adapter / "adapter_model.safetensors").read_bytes(), config, NUM_ADAPTER_TENSORS)
    rollout.update_weights([ray.put(record)], version=3)
    assert parity(pools) <= PARITY_ATOL  # the engine now serves the exported folder's adapter
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    learner_lp = np.asarray(learner.score(PROBE, PROMPT_LEN, RAW))
    assert np.max(np.abs(logprobs[PROMPT_LEN - 1 :].numpy() - learner_lp)) <= PARITY_ATOL
