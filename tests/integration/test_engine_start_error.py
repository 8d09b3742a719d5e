"""An engine that dies at start says why: a model with head size 16, which vLLM's CPU attention does not serve,
started in a Ray actor (whose output goes to Ray's log files, as a rollout worker's does). The error raised to the
caller names vLLM's own cause, not only `EngineDeadError: ... See stack trace (above)`."""

import asyncio

import pytest

pytestmark = pytest.mark.integration


def _head_16_model(out_dir):
    import torch
    from transformers import Qwen2ForCausalLM

    from asyncrl.models import Preset, build_char_tokenizer, qwen2_config

    preset = Preset(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128)  # 64 / 4 = 16
    torch.manual_seed(0)
    Qwen2ForCausalLM(qwen2_config(preset)).save_pretrained(out_dir, safe_serialization=True)
    build_char_tokenizer(preset.alphabet).save_pretrained(out_dir)
    return out_dir


def test_an_engine_dying_at_start_names_vllms_own_error(ray_cluster, tmp_path):
    import ray

    def start(model_dir: str) -> str:
        from asyncrl.rollout.engine import Engine

        engine = Engine(model_dir, max_model_len=64, max_num_seqs=4, kv_cache_gib=1)
        try:
            asyncio.run(engine.start())
        except Exception as e:  # the message is what a run's output shows
            return f"{type(e).__name__}: {e}"
        return "started"

    model_dir = _head_16_model(tmp_path / "head16")
    error = ray.get(ray.remote(num_cpus=1)(start).remote(str(model_dir)), timeout=180)  # a Ray worker, as in a run
    print(error)
    assert error.startswith("EngineStartError: ")
    assert "the engine's own error: " in error and "head_dim=16" in error
