"""Shared fixtures. Environment for Ray and vLLM-on-CPU is set before anything imports them."""

import asyncio
import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (CI must not flake); HYPOTHESIS_PROFILE=explore
# draws fresh ones to hunt for new failures locally.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 4-layer Qwen2 with tied embeddings and the 16-token `add` vocabulary (~0.3M params)."""
    from asyncrl.models import build_model

    return build_model("tiny-0.3m", tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 (`asyncrl.testing.S3Server`) with one bucket; its credentials are
    put in this process's environment first, so that every Ray started afterwards (whose workers inherit it) and
    every node a test starts reaches it. Session-wide: it starts before any module's Ray."""
    from asyncrl.testing import S3_TEST_ENV, S3Server

    saved = {key: os.environ.get(key) for key in S3_TEST_ENV}
    os.environ.update(S3_TEST_ENV)
    server = S3Server()
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray per test module (starting Ray costs ~5-8 s)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def loop():
    """One asyncio loop per module, for tests that drive an in-process `Engine` (its background tasks live on it)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def module_engine(loop, model_dir, max_model_len: int = 512, weight_load: str = "auto"):
    """A started in-process engine on `loop` for a module fixture to yield; the fixture shuts it down."""
    from asyncrl.rollout.engine import Engine

    engine = Engine(str(model_dir), name="engine-0", max_model_len=max_model_len, max_num_seqs=64, kv_cache_gib=1, weight_load=weight_load)
    loop.run_until_complete(engine.start())
    return engine
