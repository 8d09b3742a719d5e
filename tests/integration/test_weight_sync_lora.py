"""`learner.lora` end to end on real Ray, a real FSDP2 (gloo) learner rank and a real vLLM CPU engine serving the
tiny model with vLLM's LoRA, all shared by the module: version 0 is the base model on both sides; after a step
only the adapter travels (`AdapterSync`) and the engine scores as the learner; the tokens of requests running
across an adapter update come from the adapter their versions name; the exported PEFT adapter folder loads in vLLM
and the merged model in transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from asyncrl.algo.sampling import RAW
from asyncrl.config import LoraConfig, WeightSyncConfig
from tests.integration.weight_sync_checks import PARITY_ATOL, PROBE, PROMPT_LEN, parity, wired_pools

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
    from asyncrl.weight_sync.adapter import AdapterSync

    config = WeightSyncConfig(timeout_s=60.0)
    with wired_pools(tiny_model_dir, lambda learner, rollout: AdapterSync(learner, rollout, config, "streaming"), LORA) as pools:
        yield pools


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


def _merged_model(model_dir, published):
    """The base model with the adapter of `published` (an `AdapterSync` record) folded in, in this process."""
    import ray
    import torch
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.lora import PEFT_PREFIX, merged

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    adapter = {k.removeprefix(PEFT_PREFIX): t for k, t in load(ray.get(published.refs[0]).data).items()}
    state = merged({**model.state_dict(), **adapter}, LORA.alpha / LORA.rank)
    model.load_state_dict(state, strict=False)
    return model


def _response_logprobs(model, ids, prompt_len: int, then=None, switch: int = 0):
    """Log-probs of the response tokens of `ids` [1, L] under `model`; with `then`, `model` computes positions
    before `switch` and `then` the rest on top of `model`'s KV cache."""
    import torch

    with torch.no_grad():
        if then is None:
            logits = model(ids).logits
        else:
            cache = model(ids[:, :switch], use_cache=True)
            rest = then(ids[:, switch:], past_key_values=cache.past_key_values, use_cache=True)
            logits = torch.cat([cache.logits, rest.logits], dim=1)
    logprobs = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs[prompt_len - 1 :]


def test_the_tokens_after_an_update_in_flight_come_from_the_new_adapter(pools, tiny_model_dir):
    """Requests running across the sync: the tokens labelled with the old version have the old adapter's log-probs
    (<= 1e-5); those labelled with the new one the new adapter's, computed on the KV cache the old adapter left
    (<= 1e-5), and not the old adapter's."""
    import time

    import ray
    import torch

    from asyncrl.testing import random_groups

    def _start_requests(worker, prompts: list[list[int]], max_tokens: int) -> None:
        """Inside the rollout worker actor: one request per prompt, sampled at temperature 1 on its engine, run on the
        actor's event loop (vLLM's output handler's); `_trajectories` collects them (with the engine's log-probs and
        per-token versions)."""
        import asyncio

        from asyncrl.rollout.sampling import SamplingSpec
        from asyncrl.types import Prompt, Request

        spec = SamplingSpec(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        requests = [Request(f"fl-{i}/0/0", f"fl-{i}", 0, 1, Prompt(f"fl-{i}", p, "")) for i, p in enumerate(prompts)]
        loop = worker.engine._llm.output_handler.get_loop()
        worker._in_flight_test = [
            asyncio.run_coroutine_threadsafe(worker.engine.generate(r, spec), loop) for r in requests
        ]

    def _trajectories(worker):
        tasks = worker._in_flight_test
        return [t.result() for t in tasks] if all(t.done() for t in tasks) else None

    learner, rollout, sync = pools
    worker, v = rollout.handle(rollout.names[0]), max(rollout.versions().values())
    old = sync.latest() if sync.finish(sync.start(v + 1)) else None  # the engine serves the learner's adapter
    learner.train_step(random_groups(seed=2))
    prompts = [[1, 4, 9, 14], [5, 15, 7], [3, 12], [6, 11, 8]]
    ray.get(worker.__ray_call__.remote(_start_requests, prompts, 56))
    result = sync.finish(sync.start(v + 2))
    deadline = time.monotonic() + 60
    while (done := ray.get(worker.__ray_call__.remote(_trajectories))) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done is not None and old is not None and result.version == v + 2
    models = {label: _merged_model(tiny_model_dir, record) for label, record in (("old", old), ("new", sync.latest()))}
    gaps: dict[str, list[float]] = {"old": [], "new": [], "new vs old": []}
    for t in done:
        ids, n = torch.tensor([[int(x) for x in (*t.prompt_ids, *t.response_ids)]]), len(t.prompt_ids)
        assert len(t.response_ids) == 56 and set(t.versions.tolist()) <= {v + 1, v + 2}
        first_new = int(np.argmax(t.versions == v + 2)) if (t.versions == v + 2).any() else len(t.versions)
        all_old = _response_logprobs(models["old"], ids, n)
        # vLLM keeps the KV cache of the positions it computed before the update: the new adapter continues from
        # the old adapter's keys and values, as a Hugging Face model continuing from the old model's cache does
        served = _response_logprobs(models["old"], ids, n, models["new"], n + first_new - 1) if first_new else None
        engine = torch.from_numpy(np.asarray(t.rollout_logprobs, dtype=np.float32))
        gaps["old"] += (engine[:first_new] - all_old[:first_new]).abs().tolist()
        if served is not None:
            gaps["new"] += (engine[first_new:] - served[first_new:]).abs().tolist()
            gaps["new vs old"] += (engine[first_new:] - all_old[first_new:]).abs().tolist()
    assert gaps["old"] and gaps["new"], f"no request straddled the update: {[t.versions for t in done]}"
    print({k: f"{max(g):.1e} over {len(g)} tokens" for k, g in gaps.items()})
    assert max(gaps["old"]) <= PARITY_ATOL and max(gaps["new"]) <= PARITY_ATOL
    assert max(gaps["new vs old"]) > 1e-3  # the old adapter alone would not have produced them
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
    rollout.update_weights([ray.put(record)], version=max(rollout.versions().values()) + 1)
    assert parity(pools) <= PARITY_ATOL  # the engine now serves the exported folder's adapter
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    learner_lp = np.asarray(learner.score(PROBE, PROMPT_LEN, RAW))
    assert np.max(np.abs(logprobs[PROMPT_LEN - 1 :].numpy() - learner_lp)) <= PARITY_ATOL
