"""MoE routing replay (asyncrl.learner.routing) on tiny random-init Qwen3-MoE and Mixtral models built in memory."""

import pytest
import torch

from asyncrl.learner.routing import RouteRecorder, moe_routers, replaying, route_shape


def qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    for router in moe_routers(model):  # wider than the 0.02 init: no route is a near-tie
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


def mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).eval()


def own_routes(model, ids):
    recorder = RouteRecorder(model)
    with torch.no_grad():
        logits = model(ids).logits
    recorder.close()
    return logits, recorder.routes(*ids.shape)


IDS = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build", [qwen3_moe, mixtral])
def test_replaying_own_routes_is_the_normal_forward_exactly(build):
    model = build()
    logits, routes = own_routes(model, IDS)
    assert routes.shape == (3, 7, 2, 2) and route_shape(model) == (2, 2)
    with torch.no_grad(), replaying(model, routes):
        replayed = model(IDS).logits
    assert torch.equal(replayed, logits)
    with torch.no_grad(), replaying(model, torch.full_like(routes, -1)):  # -1: every token takes its own top-k
        assert torch.equal(model(IDS).logits, logits)


def test_a_flipped_route_changes_that_token_and_later_ones_only():
    model = qwen3_moe()
    logits, routes = own_routes(model, IDS)
    flipped = routes.clone()
    own = set(routes[0, 3, 0].tolist())
    flipped[0, 3, 0] = torch.tensor([e for e in range(8) if e not in own][:2])  # token 3 of row 0, first MoE layer
    with torch.no_grad(), replaying(model, flipped):
        out = model(IDS).logits
    # Earlier positions and other rows: unaffected up to rounding (an expert's matmul now covers other rows).
    torch.testing.assert_close(out[0, :3], logits[0, :3], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1:], logits[1:], rtol=0, atol=1e-6)
    assert (out[0, 3] - logits[0, 3]).abs().max() > 1e-3


def test_replayed_block_output_is_the_gated_sum_of_the_replayed_experts():
    """By hand: with experts (5, 1) replayed, one token's MoE output is w5 * E5(x) + w1 * E1(x), where w is the
    router's softmax over all 8 experts taken at 5 and 1 and renormalised over them."""
    block = qwen3_moe().model.layers[0].mlp
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), replaying(block, torch.tensor([[[[5, 1]]]])):
        out = block(x)[0, 0]
    probs = torch.softmax(x[0, 0] @ block.gate.weight.T, -1)
    w = probs[[5, 1]] / probs[[5, 1]].sum()

    def expert(e):
        gate, up = (block.experts.gate_up_proj[e] @ x[0, 0]).chunk(2)
        return block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)

    expected = w[0] * expert(5) + w[1] * expert(1)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)


def test_gradient_reaches_the_router_under_replay():
    model = qwen3_moe()
    _, routes = own_routes(model, IDS)
    routes = (routes + 3) % 8  # other experts than the router's own choice
    with replaying(model, routes):
        model(IDS).logits.square().mean().backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_routes_that_do_not_fit_the_model_are_refused():
    model = qwen3_moe()
    with pytest.raises(ValueError, match=r"\[B, L, 2 MoE layers, top_k 2\]"), replaying(model, torch.zeros(3, 7, 3, 2)):
        pass
    with pytest.raises(ValueError, match="has no MoE router"):
        route_shape(torch.nn.Linear(2, 2))


def test_the_learner_step_scores_with_the_routes_its_batch_carries():
    from types import SimpleNamespace

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import SamplingDistribution
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.policy import PolicyModel
    from asyncrl.learner.step import RankStep
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    policy = PolicyModel(qwen3_moe())
    step = RankStep(SimpleNamespace(policy=policy), None, None, SamplingDistribution(), torch.device("cpu"), None)
    plain_batch = build_batch([Group("g", [make_trajectory([5, 6, 7, 8])])], resolve_recipe("grpo"))
    with torch.no_grad():
        plain = step._logprobs(plain_batch)  # no routes: the learner's own routing
        _, own = own_routes(policy.causal_lm, plain_batch.input_ids)
        flipped = own[0, :6].numpy().astype("uint8")  # the engine's routes: 6 of the 7 tokens
        flipped[4, 1] = [e for e in range(8) if e not in set(flipped[4, 1].tolist())][:2]  # token 4, second MoE layer
        replayed_batch = build_batch(
            [Group("g", [make_trajectory([5, 6, 7, 8], routed_experts=flipped)])], resolve_recipe("grpo")
        )
        replayed = step._logprobs(replayed_batch)
    torch.testing.assert_close(replayed[0, :4], plain[0, :4], rtol=0, atol=1e-6)  # columns before token 4
    assert (replayed[0, 4] - plain[0, 4]).abs() > 1e-4  # column 4 runs token 4's hidden state: rerouted
