"""The engine worker's side of delta sync (`WeightReceiver`, fake model): in place it loads only the tensors that
changed (every expert tensor again, as the experts are re-packed whole), a reloading engine gets the whole state, and
a delta it cannot apply loads nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.rollout.vllm_compat.weights import WeightReceiver
from asyncrl.weights.buckets import pack_buckets
from asyncrl.weights.delta import BASE_MISMATCH, DeltaEncoder

@pytest.fixture(autouse=True)
def no_vllm_kernels(monkeypatch):
    """The fake model has no CPU experts and nothing to unpack; skip vLLM's imports (tens of seconds here)."""
    monkeypatch.setattr("asyncrl.rollout.vllm_compat.weights.repack_cpu_experts", lambda model: 0)
    monkeypatch.setattr("asyncrl.rollout.vllm_compat.weights._unpack_linear_layers", lambda model: True)


NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.q_proj.weight"]


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loads: list[list[str]] = []

    def load_weights(self, named):
        self.loads.append([name for name, _ in named])
        return self.loads[-1]


class Worker(WeightReceiver):
    def __init__(self):
        self.model = FakeModel()
        self.reloads: list[list[str]] = []
        self.model_runner = SimpleNamespace(get_model=lambda: self.model,
                                            reload_weights=lambda weights_iterator: self.reloads.append([n for n, _ in weights_iterator]))
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=False)))

    def send(self, entries, in_place=True):
        for i, data in enumerate(pack_buckets(entries, 1 << 10)):
            self.asyncrl_stage_weight_bucket(data, i == 0)
        return self.asyncrl_load_staged_weights(in_place)


def state(scale):
    return {name: torch.full((4, 4), float(i) * scale) for i, name in enumerate(NAMES)}


def test_in_place_a_delta_loads_the_changed_tensors_and_every_expert():
    worker, encoder = Worker(), DeltaEncoder()
    assert worker.send(encoder.encode(state(1.0), 1)) == 3
    moved = state(1.0)
    moved[NAMES[2]] += 1
    assert worker.send(encoder.encode(moved, 2)) == 1
    assert [sorted(x) for x in worker.model.loads] == [sorted(NAMES), sorted(NAMES[1:])]


def test_a_reloading_engine_gets_the_whole_state_and_a_refused_delta_loads_nothing():
    worker, encoder = Worker(), DeltaEncoder()
    worker.send(encoder.encode(state(1.0), 1), in_place=False)
    encoder.encode(state(2.0), 2)  # never sent
    with pytest.raises(RuntimeError, match=BASE_MISMATCH):
        worker.send(encoder.encode(state(3.0), 3), in_place=False)
    assert [sorted(r) for r in worker.reloads] == [sorted(NAMES)]
    worker.send(encoder.full(), in_place=False)
    assert [sorted(r) for r in worker.reloads] == [sorted(NAMES)] * 2 and worker.model.loads == []
