"""`model.dtype: bfloat16` on a real FSDP2 rank (gloo, one rank, in this process): bf16 decoder layers,
fp32 master weights, optimizer state, head and gradient reductions, bf16 weights for the engines."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from asyncrl.algo.recipes import resolve_recipe
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.batch import build_batch

from .helpers import random_groups

LR = 1e-5
"""Adam's first step moves a weight by lr * g / (|g| + eps) ~ 1e-5, far below bf16 spacing at |w| > 0.01
(2^-7 * 2^-7 = 6.1e-5 for |w| in [2^-7, 2^-6)): a bf16 master weight would not move at all."""


@pytest.fixture(scope="module")
def rank(tiny_model_dir):
    from asyncrl.learner.rank import LearnerWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = LearnerWorker(0, 1, str(tiny_model_dir), LearnerConfig(lr=LR, grad_clip=1e9), resolve_recipe("grpo"), RAW, "bfloat16")
    worker.setup(("127.0.0.1", port), 60.0)
    yield worker
    worker.shutdown()


def _dtypes_seen_in_forward(worker) -> dict[str, torch.dtype]:
    """Weight dtypes while the forward runs (FSDP2 casts when it all-gathers, so only a hook sees them)."""
    lm, seen = worker.state.policy.causal_lm, {}

    def record(key: str, of_output: bool = False):
        def hook(module, inputs, output) -> None:  # returns None: the output is left alone
            seen[key] = output.dtype if of_output else module.weight.dtype

        return hook

    hooks = [
        lm.model.layers[0].self_attn.q_proj.register_forward_hook(record("layer")),
        lm.model.embed_tokens.register_forward_hook(record("embed")),
        lm.model.norm.register_forward_hook(record("norm_out", of_output=True)),
    ]
    try:
        out = worker.score([1, 5, 6, 7, 4], 2)
    finally:
        for h in hooks:
            h.remove()
    seen["head"] = lm.get_output_embeddings().weight.dtype
    seen["logprobs"] = torch.as_tensor(out).dtype
    return seen


def test_layers_compute_in_bf16_while_embeddings_head_and_logprobs_stay_fp32(rank):
    seen = _dtypes_seen_in_forward(rank)
    assert seen["layer"] == torch.bfloat16
    assert seen["embed"] == seen["head"] == seen["norm_out"] == torch.float32  # tied: the head is the embedding
    assert seen["logprobs"] == torch.float32


def test_master_weights_and_optimizer_state_are_fp32_and_a_tiny_update_accumulates(rank):
    from asyncrl.learner.batch import split_mini_batches, split_rows

    before = {k: v.copy() for k, v in rank.state_snapshot()["params"].items()}  # one CPU rank: views of the params
    recipe = rank.recipe
    batch = build_batch(random_groups(num_groups=3, group_size=3, seed=1), recipe)
    shards = [split_rows(part, 1)[0] for part in split_mini_batches(batch, 1, recipe)]
    stats = rank.train_step(shards)
    assert np.isfinite(stats.loss) and stats.grad_norm > 0
    params = list(rank.state.policy.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    moments = [v for state in rank.state.optimizer.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    after = rank.state_snapshot()["params"]
    name = "model.layers.0.mlp.up_proj.weight"
    delta = np.abs(after[name] - before[name])
    moved = (delta > 0) & (np.abs(before[name]) > 0.01)
    # Fresh AdamW: |step| = lr * |g| / (|g| + eps) = 1e-5 wherever |g| >> eps = 1e-8.
    assert moved.sum() > 0.5 * (np.abs(before[name]) > 0.01).sum()
    assert np.median(delta[moved]) == pytest.approx(LR, rel=1e-3)
    # In bf16 the same weights would not have moved: the update is below their resolution.
    after_bf16, before_bf16 = (torch.from_numpy(a).to(torch.bfloat16) for a in (after[name], before[name]))
    assert (after_bf16 == before_bf16).numpy()[moved].mean() > 0.9


def test_weights_leave_for_the_engines_as_bf16_roundings_of_the_fp32_masters(rank):
    from asyncrl.learner.export import pack_state_dict
    from asyncrl.weights.buckets import unpack_bucket

    state = rank._hf_state()
    buckets, _, num_tensors = pack_state_dict(state, 1 << 20, rank.dtype)
    sent = {k: v for b in buckets for k, v in unpack_bucket(b).items()}
    assert len(sent) == num_tensors == len(state)
    for name, tensor in sent.items():
        assert state[name].dtype == torch.float32, name
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_cpu_bf16_attention_is_plain_matmuls_and_scores_match_fp32_within_bf16_rounding(rank, tiny_model_dir):
    from asyncrl.learner.policy import load_causal_lm

    from torch.distributed.device_mesh import init_device_mesh

    from asyncrl.learner.policy import ValueModel, shard

    assert rank.state.policy.causal_lm.config._attn_implementation == "eager"  # not SDPA's slow bf16 flash backward
    critic = ValueModel(load_causal_lm(str(tiny_model_dir)))
    shard(critic, init_device_mesh("cpu", (1,)), torch.bfloat16)
    assert critic.trunk.config._attn_implementation == "eager"  # sao's critic too
    token_ids, prompt_len = [1, 5, 6, 7, 4, 9, 3, 8], 2
    reference = load_causal_lm(str(tiny_model_dir))  # fp32, SDPA
    with torch.no_grad():
        logits = reference(torch.tensor([token_ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(prompt_len - 1, len(token_ids) - 1), torch.tensor(token_ids[prompt_len:])]
    got = torch.as_tensor(rank.score(token_ids, prompt_len))
    assert got.shape == expected.shape
    print(f"bf16 learner vs fp32 log-probs: max |diff| = {(got - expected).abs().max():.2e}")
    assert torch.allclose(got, expected, atol=0.01)  # bf16 layers: ~3 significant digits (5.9e-3 here)


def _bf16_policy(tiny_model_dir, wrap):
    from asyncrl.learner.policy import PolicyModel, load_causal_lm

    policy = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    policy.transformer.set_attn_implementation("eager")
    wrap(policy)
    return policy


def _logprobs_and_gradients(policy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ids = torch.randint(3, 16, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    positions = torch.arange(9).expand(3, 9)
    out = policy(ids, mask, positions, RAW)
    (torch.where(mask.bool(), out, 0.0) * torch.linspace(-1.0, 1.0, 9)).sum().backward()
    grads = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in policy.named_parameters()}
    return out.detach(), grads


def test_one_rank_bf16_without_fsdp_computes_what_fsdp_mixed_precision_does(rank, tiny_model_dir):  # rank: the process group
    """`shard` on one rank leaves the module plain and casts its layers with hooks (`cast_layers`): its log-probs
    and fp32 gradients equal, bit for bit, those of FSDP2's `MixedPrecisionPolicy(bf16, fp32)` on the same rank
    (`learner.fsdp: always`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from asyncrl.learner.policy import shard

    mesh = init_device_mesh("cpu", (1,))
    plain = _bf16_policy(tiny_model_dir, lambda m: shard(m, mesh, torch.bfloat16))
    fsdp = _bf16_policy(tiny_model_dir, lambda m: shard(m, mesh, torch.bfloat16, "always"))
    assert not isinstance(plain, FSDPModule) and isinstance(fsdp, FSDPModule)
    got, got_grads = _logprobs_and_gradients(plain)
    expected, expected_grads = _logprobs_and_gradients(fsdp)
    fp32, _ = _logprobs_and_gradients(_bf16_policy(tiny_model_dir, lambda m: None))
    real = torch.isfinite(expected)
    assert (got[real] - fp32[real]).abs().max() > 1e-4  # bf16 moved them: the casts happened
    assert torch.equal(got[real], expected[real])
    assert set(got_grads) == set(expected_grads)
    for name, grad in got_grads.items():
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, expected_grads[name]), name
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in plain.parameters())


def test_a_layer_that_raises_gets_its_fp32_masters_back(rank, tiny_model_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from asyncrl.learner.policy import shard

    policy = _bf16_policy(tiny_model_dir, lambda m: shard(m, init_device_mesh("cpu", (1,)), torch.bfloat16))
    masters = list(policy.parameters())
    with pytest.raises(Exception):
        policy(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1]]), RAW)  # positions too short
    assert [id(p) for p in policy.parameters()] == [id(p) for p in masters]
