"""Shared fixtures. Environment for Ray and vLLM-on-CPU is set before anything imports them."""

import asyncio
import os
import sys

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


_SHARED_RAY: dict[str, dict[str, str]] = {}
"""The environment the test process's local Ray started with (its workers inherit it)."""


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for the module. The modules of a test process take turns on one Ray (a start costs ~10 s and
    ~7 s of CPU): a module gets a fresh one when the environment differs from the one Ray's workers inherited, and
    a module that leaves an actor alive or a resource held ends its Ray, so the next module never sees its state."""
    import ray

    if ray.is_initialized() and _SHARED_RAY.get("env") != _environment():
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        _SHARED_RAY["env"] = _environment()
    yield ray
    if not _ray_is_idle(ray):
        ray.shutdown()


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # the test's name changes, not its setup


def _ray_is_idle(ray, timeout_s: float = 5.0) -> bool:
    """Every actor dead and every resource free again (a killed actor's resources return shortly after)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
            total, free = ray.cluster_resources(), ray.available_resources()
        except Exception:
            return False
        if not alive and all(abs(free.get(k, 0.0) - v) < 1e-6 for k, v in total.items()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_in_modules_without_ray_cluster(request):
    """A module that does not ask for `ray_cluster` starts (or joins) its own Ray, as if none ran in this process."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        items = [item for item in request.session.items if item.module is request.module]
        if not any("ray_cluster" in item.fixturenames for item in items):
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
