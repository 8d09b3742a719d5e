"""Routes from the engine's output to the learner's batch (MoE routing replay): the trajectory field, its trip
through the queue's wire form, `build_batch`'s layout, the engine-output parser and `asyncrl check`."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.learner.batch import build_batch, micro_batches, split_rows
from asyncrl.rollout.vllm_compat.routes import ENGINE_CANNOT_RETURN_ROUTES, routed_experts, routes_problem
from asyncrl.testing import make_group, make_trajectory
from asyncrl.types import Group, PackedTrajectories


def _routes(tokens: int, first: int) -> np.ndarray:
    """[tokens, 2 layers, top-2] with hand-checkable ids: token n, layer l -> (first + n + l) % 8 and the next one."""
    base = (first + np.arange(tokens)[:, None] + np.arange(2)[None, :]) % 8
    return np.stack([base, (base + 1) % 8], axis=-1).astype(np.uint8)


def test_routes_cross_the_queue_wire_with_the_trajectory():
    with_routes = make_trajectory(4, routed_experts=_routes(6, 0))  # 3 prompt + 4 response tokens, last unrouted
    without = make_trajectory(2, sample_index=1)
    back = pickle.loads(pickle.dumps(PackedTrajectories([with_routes, without]))).trajectories()
    assert np.array_equal(back[0].routed_experts, _routes(6, 0)) and back[0].routed_experts.dtype == np.uint8
    assert back[1].routed_experts is None


def test_a_trajectory_refuses_more_route_rows_than_tokens():
    with pytest.raises(ValueError, match=r"routed_experts of shape \(8, 2, 2\) for 7 tokens"):
        make_trajectory(4, routed_experts=_routes(8, 0))


def test_build_batch_lays_routes_out_by_token_position_with_minus_one_elsewhere():
    a = make_trajectory(4, routed_experts=_routes(6, 0))  # 7 tokens
    b = make_trajectory(2, sample_index=1)  # 5 tokens, no routes: the learner routes them itself
    batch = build_batch([Group("g0", [a, b])], resolve_recipe("grpo"))
    routes = batch.routed_experts
    assert routes.shape == (2, 7, 2, 2) and routes.dtype == torch.int16
    assert routes[0, :6].tolist() == _routes(6, 0).tolist()
    assert (routes[0, 6] == -1).all() and (routes[1] == -1).all()
    # Row selection trims the position axis with the others: row b alone is 5 wide.
    assert [r.routed_experts.shape for r in split_rows(batch, 2)] == [(1, 7, 2, 2), (1, 5, 2, 2)]
    (only_b,) = micro_batches(batch.select([1]), 100)
    assert torch.equal(only_b.routed_experts, torch.full((1, 5, 2, 2), -1, dtype=torch.int16))


def test_a_batch_without_routes_has_none():
    assert build_batch([make_group()], resolve_recipe("grpo")).routed_experts is None


def test_build_batch_refuses_routes_of_different_models():
    a = make_trajectory(4, routed_experts=_routes(6, 0))
    b = make_trajectory(2, sample_index=1, routed_experts=np.zeros((4, 3, 2), np.uint8))
    with pytest.raises(ValueError, match=r"disagree on \[moe_layers, top_k\]"):
        build_batch([Group("g0", [a, b])], resolve_recipe("grpo"))


def test_routed_experts_reads_vllms_completion_compactly():
    assert routed_experts(SimpleNamespace(routed_experts=None)) is None
    assert routed_experts(SimpleNamespace()) is None  # an output class without the field
    small = routed_experts(SimpleNamespace(routed_experts=np.array([[[7, 3]]], np.int32)))
    assert small.dtype == np.uint8 and small.tolist() == [[[7, 3]]]
    wide = routed_experts(SimpleNamespace(routed_experts=np.array([[[300, 3]]], np.int32)))
    assert wide.dtype == np.int16 and wide.tolist() == [[[300, 3]]]


def test_routing_replay_needs_a_known_moe_family_and_an_engine_that_returns_routes():
    assert "model_type 'qwen2' is not an MoE family" in routes_problem({"model_type": "qwen2"})
    assert "is not an MoE family" in routes_problem({"model_type": "qwen3_moe"})  # no expert count
    assert routes_problem({"model_type": "qwen3_moe", "num_experts": 8}) == ENGINE_CANNOT_RETURN_ROUTES
    assert routes_problem({"model_type": "mixtral", "num_local_experts": 8}) == ENGINE_CANNOT_RETURN_ROUTES
    assert (
        "Model Runner V2 requires Triton" in ENGINE_CANNOT_RETURN_ROUTES
        and "prefix caching" in ENGINE_CANNOT_RETURN_ROUTES
    )


def test_check_rejects_routing_replay_naming_the_key(capsys, tmp_path):
    from asyncrl.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8, "head_dim": 32}')
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["check", f"model.path={tmp_path}", "learner.routing_replay=true"]) == 2
    assert f"learner.routing_replay: {ENGINE_CANNOT_RETURN_ROUTES}" in capsys.readouterr().err
    assert main(["check", "learner.routing_replay=true"]) == 2  # a preset: dense
    assert "learner.routing_replay: model_type 'the preset" in capsys.readouterr().err
