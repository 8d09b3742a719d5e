"""Every model family of `asyncrl.models.families` (Qwen2 tied and untied, Qwen3, Llama 3, Mistral, Gemma 2,
Qwen3-MoE; tiny, random init, a byte-level BPE tokenizer with the family's chat format) on real Ray, a real
learner rank and a real vLLM CPU engine (one engine start per family: most of a family's time).

Three families, one per kind of head and MLP (`FULL`: dense with a tied head, untied with Llama 3's rope scaling,
mixture of experts), go through every path of a run, with one engine:

1. a learner rank loads the checkpoint, takes a step and exports it (`export_hf`); the export reloads in
   transformers with the learner's log-probs;
2. a run starts from the export as `model.path` (so its engine start is the export's reload in vLLM, compared with
   the learner that wrote it) and trains 2 steps on verl Parquet with the parity probed after every sync, through
   a transport of its own (object store, shared memory, collective: `RUN_TRANSPORT`);
3. on the run's pools, a learner step and a sync through each transport (object store, shared memory,
   collective), with engine <-> learner parity <= 1e-5 (fp32) after each and > 1e-3 before it.

Every other family (`OTHERS`) gets one learner rank and one engine on its checkpoint (parity at the engine's start),
a learner step whose export reloads in transformers with the learner's log-probs, and the step's weights packed as
the object-store transport packs them, loaded by the engine, with parity > 1e-3 before and <= 1e-5 after. Its
engine runs in this process, so only the first of them imports vLLM: an engine start is most of a family's time.
The export is written by the same `save_pretrained` as the checkpoint the engine loaded, and the transports are the
same for every family (the full families and tests/integration/test_weight_sync_* cover each).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from asyncrl.models.families import FAMILIES
from tests.conftest import module_engine
from tests.families import build_families

pytestmark = pytest.mark.integration

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)

PARITY_ATOL = 1e-5
TRANSPORTS = ("object_store", "shared_memory", "collective")
FULL = ("qwen2", "llama3", "qwen3-moe")
"""The families that go through every path of a run (module docstring)."""
OTHERS = tuple(name for name in FAMILIES if name not in FULL)
"""Every other family: a step, an export and a sync (module docstring)."""
RUN_TRANSPORT = {name: TRANSPORTS[i] for i, name in enumerate(FULL)}
"""The transport of each full family's run."""
MESSAGES = [{"role": "user", "content": "What is 12+30? Answer with the number."}]
ANSWER = "The answer is 42."


@dataclass
class Exercised:
    """What one family went through (module docstring), as numbers the tests check."""

    export_in_transformers: float = float("nan")
    engine_at_start: float = float("nan")
    """The started engine against the learner with the same weights: the export (`FULL`), else the checkpoint."""
    run_parities: list[float] = field(default_factory=list)
    run_summary: dict = field(default_factory=dict)
    syncs: dict[str, tuple[float, float]] = field(default_factory=dict)
    """transport -> (parity before the sync, after it)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the family's start to the end of each phase."""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return build_families(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def train_parquet(tmp_path_factory) -> Path:
    from asyncrl.envs.data import write_verl_parquet

    rows = [
        {"data_source": "add", "prompt": [{"role": "user", "content": f"What is {i}+{i + 3}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)}, "extra_info": {"index": i}}
        for i in range(16)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_verl_parquet(rows, path)
    return path


@pytest.fixture(scope="module", params=FULL)
def exercised(request, ray_cluster, family_dirs, train_parquet, tmp_path_factory) -> tuple[str, Exercised]:
    name = request.param
    began, result = time.perf_counter(), Exercised()
    tmp = tmp_path_factory.mktemp(name)
    probe, prompt_len = _probe(family_dirs[name])
    export, learner_logprobs = _step_and_export(family_dirs[name], tmp / "export", probe, prompt_len)
    result.phases["step and export"] = time.perf_counter() - began
    result.export_in_transformers = _max_gap(_transformers_logprobs(export, probe, prompt_len), learner_logprobs)
    controller = _controller(name, export, train_parquet, tmp / "run")
    try:
        controller.start()
        result.phases["run start"] = time.perf_counter() - began
        fleet = controller.fleet
        result.engine_at_start = _max_gap(fleet.rollout.score(probe, prompt_len), learner_logprobs)
        result.run_summary = controller.run()
        result.run_parities = [row["parity_max_abs_diff"] for row in controller.records.history]
        result.phases["run"] = time.perf_counter() - began
        _every_transport(fleet, probe, prompt_len, result)
        result.phases["transports"] = time.perf_counter() - began
    finally:
        controller.shutdown()
    result.phases["shutdown"] = time.perf_counter() - began
    print(f"\n{name}: {json.dumps({k: v for k, v in vars(result).items() if k != 'run_summary'})}")
    return name, result


@pytest.fixture(scope="module", params=OTHERS)
def synced(request, ray_cluster, loop, family_dirs, tmp_path_factory) -> tuple[str, Exercised]:
    """A family outside `FULL`: its checkpoint in a learner rank and in an engine of this process (its engines
    start one after another: only the first imports vLLM), a step, an export, and the step's weights as the
    object-store transport's buckets loaded by the engine."""
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import WeightSyncConfig
    from asyncrl.testing import random_groups

    name, began, result = request.param, time.perf_counter(), Exercised()
    probe, prompt_len = _probe(family_dirs[name])
    learner = _learner(family_dirs[name])
    engine = module_engine(loop, family_dirs[name], max_model_len=128)
    try:
        result.phases["start"] = time.perf_counter() - began
        logprobs = lambda: np.asarray(learner.score(probe, prompt_len, RAW))  # noqa: E731
        scored = lambda: loop.run_until_complete(engine.score(probe, prompt_len))  # noqa: E731
        result.engine_at_start = _max_gap(scored(), logprobs())
        learner.train_step(random_groups(seed=1, vocab=2048))
        export = tmp_path_factory.mktemp(name) / "export"
        learner.export_hf(export)
        result.export_in_transformers = _max_gap(_transformers_logprobs(export, probe, prompt_len), logprobs())
        before = _max_gap(scored(), logprobs())
        buckets = ray_cluster.get(learner.export_weights(WeightSyncConfig().bucket_bytes).refs)
        assert loop.run_until_complete(engine.update_weights(buckets, 1)) > 0 and engine.version == 1, name
        result.syncs["object_store"] = (before, _max_gap(scored(), logprobs()))
        result.phases["step, export and sync"] = time.perf_counter() - began
    finally:
        loop.run_until_complete(engine.shutdown())
        learner.shutdown()
    result.phases["shutdown"] = time.perf_counter() - began
    print(f"\n{name}: {json.dumps(vars(result))}")
    return name, result


def _learner(model_dir: Path):
    """One learner rank on `model_dir` (grpo, lr 1e-2: a step moves the log-probs by > 1e-3)."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.pool import LearnerPool

    return LearnerPool(model_dir, LearnerConfig(num_ranks=1, tokens_per_microbatch=4096, lr=1e-2), resolve_recipe("grpo"))


def _probe(model_dir: Path) -> tuple[list[int], int]:
    """A chat-formatted prompt (the family's template) and an answer: the sequence the parity checks score."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = list(tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False))
    return prompt + tokenizer(ANSWER, add_special_tokens=False).input_ids, len(prompt)


def _step_and_export(model_dir: Path, export: Path, probe: list[int], prompt_len: int) -> tuple[Path, np.ndarray]:
    """A learner rank's step from the checkpoint, its log-probs of the probe, and its Hugging Face export."""
    from asyncrl.algo.sampling import RAW
    from asyncrl.testing import random_groups

    learner = _learner(model_dir)
    try:
        learner.train_step(random_groups(seed=1, vocab=2048))
        logprobs = np.asarray(learner.score(probe, prompt_len, RAW))
        learner.export_hf(export)
    finally:
        learner.shutdown()
    return export, logprobs


def _transformers_logprobs(model_dir: Path, probe: list[int], prompt_len: int) -> np.ndarray:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' SDPA drops attention soft-capping (Gemma 2); its eager attention is the model's definition.
    capped = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **({"attn_implementation": "eager"} if capped else {}))
    ids = torch.tensor([probe])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return logprobs[prompt_len - 1 : -1].gather(-1, ids[0, prompt_len:, None])[:, 0].numpy()


def _controller(name: str, model_dir: Path, train_parquet: Path, out: Path):
    from asyncrl.config import load_config
    from asyncrl.controller.loop import Controller

    overrides = {
        "mode": "streaming", "output_dir": str(out), "model.path": str(model_dir), "model.warm_start_examples": 0,
        "data.task": "parquet", "data.train_path": str(train_parquet), "env.reward": "tests.families:even_length_reward",
        "rollout.samples_per_prompt": 2, "rollout.max_tokens": 6, "rollout.max_model_len": 128,
        "buffer.max_staleness": 1, "algorithm.preset": "grpo", "learner.prompts_per_step": 2, "learner.max_steps": 2,
        "learner.lr": 1e-2, "eval.every_steps": 0, "weight_sync.parity_probe_every": 1,
        "weight_sync.transport": RUN_TRANSPORT[name], "weight_sync.timeout_s": 60.0, "telemetry.progress": False,
        "checkpoint.export_hf": False, "checkpoint.every_steps": 0,
    }  # fmt: skip
    return Controller(load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]), model_dir)


def _every_transport(fleet, probe: list[int], prompt_len: int, result: Exercised) -> None:
    """A learner step, then a sync through each transport (the run's own sync for its transport)."""
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import WeightSyncConfig
    from asyncrl.testing import random_groups
    from asyncrl.weight_sync.transport import make_weight_sync

    version = max(fleet.rollout.versions().values())
    for seed, transport in enumerate(TRANSPORTS, start=10):
        config = WeightSyncConfig(transport=transport, timeout_s=60.0)
        own = transport == fleet.cfg.weight_sync.transport
        sync = fleet.sync if own else make_weight_sync(fleet.learner, fleet.rollout, config, "streaming")
        try:
            fleet.learner.train_step(random_groups(seed=seed, vocab=2048))
            learner = lambda: np.asarray(fleet.learner.score(probe, prompt_len, RAW))  # noqa: E731
            before = _max_gap(fleet.rollout.score(probe, prompt_len), learner())
            version += 1
            assert sync.finish(sync.start(version)).version == version
            assert set(fleet.rollout.versions().values()) == {version}
            result.syncs[transport] = (before, _max_gap(fleet.rollout.score(probe, prompt_len), learner()))
        finally:
            if not own:
                sync.shutdown()


def _max_gap(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def test_the_hf_export_reloads_in_transformers_and_vllm_with_the_learners_logprobs(exercised):
    name, result = exercised
    assert result.export_in_transformers <= PARITY_ATOL, name
    assert result.engine_at_start <= PARITY_ATOL, name


def test_a_run_from_model_path_on_verl_parquet_trains_with_parity_after_every_sync(exercised):
    name, result = exercised
    assert result.run_summary["final_version"] == 2, name
    assert result.run_summary["samples_trained"] == 2 * 2 * 2, name
    assert len(result.run_parities) == 2 and max(result.run_parities) <= PARITY_ATOL, (name, result.run_parities)


def test_every_transport_restores_parity_after_a_learner_step(exercised):
    name, result = exercised
    assert set(result.syncs) == set(TRANSPORTS), name
    _assert_synced(name, result)


def test_the_other_families_start_with_parity_export_and_sync_after_a_learner_step(synced):
    name, result = synced
    assert result.engine_at_start <= PARITY_ATOL, name  # the checkpoint in vLLM and in the learner
    assert result.export_in_transformers <= PARITY_ATOL, name
    assert set(result.syncs) == {"object_store"}, name
    _assert_synced(name, result)


def _assert_synced(name: str, result: Exercised) -> None:
    for transport, (before, after) in result.syncs.items():
        assert before > 1e-3, (name, transport, before)  # the step really moved the weights (lr 1e-2)
        assert after <= PARITY_ATOL, (name, transport, after)
