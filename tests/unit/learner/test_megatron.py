"""The megatron backend (`learner.training_backend = megatron`) against transformers and the FSDP2 backend, on CPU with
real gloo groups: each family's converter gives transformers' log-probs and round-trips strictly; one step on the same
batch gives the FSDP2 step's loss, gradient norm and weights; two ranks splitting the layers (TP=2) or the rows
(DP=2) give the one-rank result; a checkpoint resumes with its step and weights, and converts to the FSDP2 backend's
and back (`switch`) exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from asyncrl.algo.recipes import resolve_recipe  # noqa: E402
from asyncrl.algo.sampling import RAW  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.learner.batch import build_batch, split_rows  # noqa: E402

from .helpers import random_groups  # noqa: E402

RECIPE = resolve_recipe("cispo")
CFG = dict(lr=1e-2, grad_clip=0.05)  # a clip that acts: the norm's reduction matters to the update
ADAM_ROUNDING = 2e-2 * CFG["lr"]
"""How far two float-rounding-equal gradients may move a weight apart in AdamW's first update, lr * g / (|g| + 1e-8)
per element: where |g| is ~1e-8, rounding differences below 1e-7 change it by a fraction of lr (measured: 4e-5 for
FSDP2 against megatron, 8.5e-5 for TP=2 against TP=1, at lr 1e-2)."""


@pytest.fixture(scope="module")
def tokenizer():
    from asyncrl.models.bpe import train_bpe

    return train_bpe("chatml", vocab_size=512)


@pytest.mark.parametrize("family", ["qwen2", "qwen2-untied", "qwen3", "llama3", "mistral", "qwen3-moe"])
def test_converter_gives_transformers_logprobs_and_round_trips(family, tokenizer, tmp_path, mesh):
    from asyncrl.learner.megatron.model import MegatronPolicy, build_gpt, init_parallel
    from asyncrl.learner.policy import PolicyModel, load_causal_lm
    from asyncrl.models.families import build_family

    hf = load_causal_lm(str(build_family(family, tmp_path, tokenizer, seed=3)))
    init_parallel(1)
    policy = MegatronPolicy(build_gpt(hf.config, 1), hf.config)
    state = hf.state_dict()
    policy.load_hf_state(state)
    ids = torch.randint(0, hf.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0  # a right-padded row
    positions = torch.arange(20).expand(3, 20) * mask
    with torch.no_grad():
        ours, theirs = policy(ids, mask, positions, RAW), PolicyModel(hf)(ids, mask, positions, RAW)
    real = mask.bool()
    real[:, -1] = False  # the last column predicts nothing
    assert (ours - theirs)[real].abs().max() < 2e-6
    assert float(theirs[real].std()) > 0.1  # a real distribution, not a constant
    back = policy.full_hf_state()
    expected = {k: v for k, v in state.items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_unknown_family_is_refused_naming_the_supported_ones():
    from types import SimpleNamespace

    from asyncrl.learner.megatron.convert import converter_for

    with pytest.raises(ValueError, match="model_type .gemma2.*qwen2, qwen3, llama, mistral, qwen3_moe"):
        converter_for(SimpleNamespace(model_type="gemma2"))


def _fsdp2_step(model_dir, mesh, batch):
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state

    cfg = LearnerConfig(**CFG)
    state = build_train_state(cfg, str(model_dir), torch.device("cpu"), lambda m: shard(m, mesh, torch.float32))
    stats = _step(state, cfg, lambda t, op="sum": t).train([batch], 0)
    weights = {k.removeprefix("causal_lm."): v.detach().clone() for k, v in state.policy.named_parameters()}
    return stats, weights


def _step(state, cfg, all_reduce):
    from asyncrl.learner.step import RankStep

    return RankStep(state, cfg, RECIPE, RAW, torch.device("cpu"), all_reduce)


def _megatron(model_dir, tensor_parallel=1, num_ranks=1):
    from asyncrl.learner.megatron.state import build_megatron_train_state, data_parallel_all_reduce

    cfg = LearnerConfig(training_backend="megatron", tensor_parallel=tensor_parallel, num_ranks=num_ranks, **CFG)
    state = build_megatron_train_state(cfg, str(model_dir), torch.device("cpu"))
    return state, _step(state, cfg, data_parallel_all_reduce)


def _batch():
    return build_batch(random_groups(num_groups=4, group_size=3, seed=5), RECIPE)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, mesh):
    """(FSDP2's step, megatron's step on one rank, megatron's train state after it) on the same batch."""
    batch = _batch()
    state, step = _megatron(tiny_model_dir)
    return _fsdp2_step(tiny_model_dir, mesh, batch), step.train([batch], 0), state


def test_megatron_step_equals_the_fsdp2_step(one_rank):
    (fsdp_stats, fsdp_weights), stats, state = one_rank
    assert stats.grad_norm > 0.05  # the clip acts
    assert stats.loss == pytest.approx(fsdp_stats.loss, abs=1e-6) and abs(stats.loss) > 1e-4
    assert stats.grad_norm == pytest.approx(fsdp_stats.grad_norm, rel=1e-5)
    assert stats.metrics["skipped_step"] == 0.0
    ours = state.policy.full_hf_state()
    assert set(ours) == set(fsdp_weights) - {"lm_head.weight"}
    # the gradients themselves agree to 1e-7 (`test_megatron_gradients_equal_the_fsdp2_gradients`)
    assert max(float((ours[k] - fsdp_weights[k]).abs().max()) for k in ours) < ADAM_ROUNDING
    shared = set(stats.metrics) & set(fsdp_stats.metrics) - {"time_optimizer_s", "time_forward_backward_s"}
    assert {"mismatch_kl", "clipfrac", "lr"} <= shared
    assert all(stats.metrics[k] == pytest.approx(fsdp_stats.metrics[k], abs=1e-5) for k in shared)


def test_megatron_gradients_equal_the_fsdp2_gradients(tiny_model_dir, mesh):
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state

    batch, cfg = _batch(), LearnerConfig(**CFG)
    fsdp = build_train_state(cfg, str(tiny_model_dir), torch.device("cpu"), lambda m: shard(m, mesh, torch.float32))
    loss, expected = _step(fsdp, cfg, lambda t, op="sum": t).gradients(batch)
    state, step = _megatron(tiny_model_dir)
    ours, grads = step.gradients(batch)  # `LearnerPool.compute_gradients` on each rank
    assert ours == pytest.approx(loss, abs=1e-7)
    assert set(grads) == set(expected) - {"lm_head.weight"}
    assert max(float(abs(g).max()) for g in expected.values()) > 1e-3  # a real gradient
    assert max(float(abs(grads[k] - expected[k]).max()) for k in grads) < 1e-7
    assert all(p.grad is None for p in state.policy.parameters())  # nothing left for a step


def test_checkpoint_resumes_the_step_and_weights(one_rank, tmp_path, tiny_model_dir):
    from asyncrl.learner.megatron.state import load_megatron_state, save_megatron_state

    _, _, state = one_rank
    save_megatron_state(str(tmp_path), state, rank=0, step=1)
    saved = {k: v.clone() for k, v in state.policy.full_hf_state().items()}
    fresh, _ = _megatron(tiny_model_dir)
    assert load_megatron_state(str(tmp_path), fresh, rank=0) == 1
    loaded = fresh.policy.full_hf_state()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
    assert fresh.scheduler.last_epoch == state.scheduler.last_epoch == 1


def _save_megatron(folder, state, extra=None):
    from asyncrl.learner.checkpoint import write_learner_state
    from asyncrl.learner.megatron.state import save_megatron_state

    save_megatron_state(str(folder), state, rank=0, step=1)
    write_learner_state(folder, step=1, version=1, num_ranks=1, extra=extra or {})


def _moments(state):
    """AdamW's moments of a megatron state by Hugging Face name (`convert.to_hf` of each moment)."""
    named = list(state.policy.gpt.named_parameters())
    return {
        m: state.policy.converter.to_hf({n: state.optimizer.state[p][m] for n, p in named}, state.policy.hf_config)
        for m in ("exp_avg", "exp_avg_sq")
    }


def test_a_megatron_checkpoint_converts_to_fsdp2_and_back(one_rank, tmp_path, tiny_model_dir, mesh):
    """megatron (TP=1) -> FSDP2 -> megatron at TP=1 (the same pieces, tensor for tensor) and at TP=2 -> FSDP2 (the
    same as the first); the FSDP2 checkpoint resumes with megatron's weights, AdamW state, schedule, step, version and
    counters, and its next step equals megatron's next step."""
    from asyncrl.learner.checkpoint import load_train_state, read_learner_state
    from asyncrl.learner.megatron.state import load_megatron_state
    from asyncrl.learner.megatron.switch import convert, to_fsdp2, to_megatron
    from asyncrl.learner.state import build_train_state

    _, _, state = one_rank
    extra = {"counters": {"samples_trained": 12}, "queue": {"pending": 3}}
    _save_megatron(tmp_path / "megatron", state, extra)
    assert to_fsdp2(str(tmp_path / "megatron"), str(tmp_path / "fsdp2"), str(tiny_model_dir)) == 1
    assert read_learner_state(tmp_path / "fsdp2") == ({"step": 1, "version": 1, "num_ranks": 1}, extra)
    cfg = LearnerConfig(**CFG)
    fsdp = build_train_state(cfg, str(tiny_model_dir), torch.device("cpu"))
    assert load_train_state(tmp_path / "fsdp2", fsdp, rank=0) == 1
    assert fsdp.scheduler.last_epoch == 1
    weights, moments = state.policy.full_hf_state(), _moments(state)
    params = {n.removeprefix("causal_lm."): p for n, p in fsdp.policy.named_parameters()}
    assert set(params) == set(weights) and all(torch.equal(params[k], weights[k]) for k in weights)
    for m, expected in moments.items():
        assert all(torch.equal(fsdp.optimizer.state[params[k]][m], expected[k]) for k in expected), m
    assert float(moments["exp_avg_sq"]["model.norm.weight"].abs().max()) > 0  # a stepped optimizer
    assert {float(s["step"]) for s in fsdp.optimizer.state.values()} == {1.0}

    assert to_megatron(str(tmp_path / "fsdp2"), str(tmp_path / "back"), str(tiny_model_dir), 1) == 1
    original = torch.load(tmp_path / "megatron/learner/megatron_tp0.pt", weights_only=True)
    back = torch.load(tmp_path / "back/learner/megatron_tp0.pt", weights_only=True)
    assert back["model"].keys() == original["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in original["model"].items() if v is not None)
    assert back["optim"]["param_groups"] == original["optim"]["param_groups"]
    for i, entry in original["optim"]["state"].items():
        assert all(torch.equal(back["optim"]["state"][i][k], v) for k, v in entry.items()), i
    assert read_learner_state(tmp_path / "back") == read_learner_state(tmp_path / "megatron")

    assert convert(str(tmp_path / "megatron"), str(tmp_path / "tp2"), str(tiny_model_dir), "megatron", 2) == 1
    assert (tmp_path / "tp2/learner/megatron_tp1.pt").is_file()
    to_fsdp2(str(tmp_path / "tp2"), str(tmp_path / "fsdp2-again"), str(tiny_model_dir))
    again = build_train_state(cfg, str(tiny_model_dir), torch.device("cpu"))
    load_train_state(tmp_path / "fsdp2-again", again, rank=0)
    assert all(torch.equal(a, b) for a, b in zip(again.policy.parameters(), fsdp.policy.parameters(), strict=True))

    resumed, step = _megatron(tiny_model_dir)
    load_megatron_state(str(tmp_path / "back"), resumed, rank=0)
    batch = _batch()
    ours, theirs = step.train([batch], 1), _step(fsdp, cfg, lambda t, op="sum": t).train([batch], 1)
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-6) and ours.grad_norm == pytest.approx(
        theirs.grad_norm, rel=1e-5
    )
    after = resumed.policy.full_hf_state()
    assert max(float((after[k] - params[k].detach()).abs().max()) for k in after) < ADAM_ROUNDING


def test_conversion_refuses_an_incomplete_or_wrong_checkpoint_and_a_used_folder(tmp_path, tiny_model_dir, capsys):
    from asyncrl.cli import main
    from asyncrl.learner.checkpoint import write_learner_state
    from asyncrl.learner.megatron.switch import to_fsdp2

    with pytest.raises(FileNotFoundError, match="not a complete learner checkpoint"):
        to_fsdp2(str(tmp_path), str(tmp_path / "out"), str(tiny_model_dir))
    write_learner_state(tmp_path, step=1, version=1, num_ranks=1, extra={})
    with pytest.raises(FileNotFoundError, match="no learner/megatron_tp0.pt, not a megatron checkpoint"):
        to_fsdp2(str(tmp_path), str(tmp_path / "out"), str(tiny_model_dir))
    with pytest.raises(FileExistsError, match="is not empty"):
        to_fsdp2(str(tmp_path), str(tmp_path), str(tiny_model_dir))
    code = main(["convert-checkpoint", str(tmp_path), str(tmp_path / "out"), "--to", "fsdp2", "--model", "m"])
    assert code == 2 and "is already an FSDP2 checkpoint" in capsys.readouterr().err


def _two_ranks(rank: int, port: int, model_dir: str, out: str, converted: str) -> None:
    """One of two processes: a step with TP=2 (both ranks the whole batch), then with DP=2 (half the rows each); then
    a TP=2 state loads the checkpoint `converted` (`switch.convert` to TP=2)."""
    import torch.distributed as dist

    from asyncrl.learner.memory import held_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {}
    batch = _batch()
    for name, tp, rows in (("tp2", 2, batch), ("dp2", 1, split_rows(batch, 2)[rank])):
        state, step = _megatron(model_dir, tensor_parallel=tp, num_ranks=2)
        _, grads = step.gradients(rows)  # `compute_gradients`: summed over DP, joined over TP
        stats = step.train([rows], 0)
        weights = state.policy.full_hf_state()
        results[name] = {
            "param_bytes": held_bytes(state)["param_bytes"],
            "grads": {k: v.tolist() for k, v in grads.items()},
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "weights": {k: v.tolist() for k, v in weights.items()},
        }
    from asyncrl.learner.megatron.state import load_megatron_state

    state, _ = _megatron(model_dir, tensor_parallel=2, num_ranks=2)
    results["converted_step"] = load_megatron_state(converted, state, rank)
    results["converted"] = {k: v.tolist() for k, v in state.policy.full_hf_state().items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_with_tp2_or_dp2_give_the_one_rank_step(one_rank, tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    from asyncrl.learner.megatron.switch import convert
    from asyncrl.learner.memory import megatron_rank_need

    _, stats, state = one_rank
    out = str(tmp_path / "two_ranks.json")
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
    _save_megatron(tmp_path / "tp1", state)
    convert(str(tmp_path / "tp1"), str(tmp_path / "tp2"), str(tiny_model_dir), "megatron", tensor_parallel=2)
    args = (_free_port(), str(tiny_model_dir), out, str(tmp_path / "tp2"))
    mp.start_processes(_two_ranks, args=args, nprocs=2, start_method="spawn")
    assert env == {k: os.environ.get(k) for k in env}
    results = json.load(open(out))
    expected = state.policy.full_hf_state()
    _, grads = _megatron(tiny_model_dir)[1].gradients(_batch())
    for name in ("tp2", "dp2"):
        got = results[name]
        assert max(float(abs(np.array(got["grads"][k]) - g).max()) for k, g in grads.items()) < 1e-7, name
        assert got["loss"] == pytest.approx(stats.loss, abs=1e-6), name
        assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5), name
        diff = max(float((torch.tensor(got["weights"][k]) - expected[k]).abs().max()) for k in expected)
        assert set(got["weights"]) == set(expected) and diff < ADAM_ROUNDING, name
    # what a rank holds is the estimate of `learner.rank_memory_gb` (a TP piece; DP replicas the whole model)
    assert results["tp2"]["param_bytes"] == megatron_rank_need(str(tiny_model_dir), 2, 2).params
    assert results["dp2"]["param_bytes"] == megatron_rank_need(str(tiny_model_dir), 1, 2).params
    assert results["converted_step"] == 1  # the TP=1 checkpoint converted to TP=2 loads the same weights
    assert all(torch.equal(torch.tensor(results["converted"][k]), v) for k, v in expected.items())


def test_the_rank_memory_of_megatron_splits_by_tensor_parallel_not_by_ranks(tiny_model_dir, tmp_path):
    """tiny-0.3m (H 64, F 256, 2 heads, 1 key-value head of 32, vocabulary 16, 4 layers, tied): 247,872 parameters.
    A TP=2 piece per layer: Q 2,048 + 32, K and V 2 x (1,024 + 16), O 2,048, gate/up/down 3 x 8,192, norms 128 =
    30,912; x 4 layers + 8 x 64 vocabulary rows + the final norm 64 = 124,224. Load: the
    model and its concatenated Q/K/V (8,320 per layer) and gate/up (32,768) copies, 247,872 + 4 x 41,088."""
    from asyncrl.learner.memory import check_rank_memory, megatron_rank_need
    from asyncrl.models import build_model

    need = megatron_rank_need(str(tiny_model_dir), tensor_parallel=2, num_ranks=4)
    assert (need.parameters, need.params, need.grads, need.optimizer) == (
        247_872,
        *(124_224 * 4 * k for k in (1, 1, 2)),
    )
    assert need.load == (247_872 + 164_352) * 4 and need.need == 124_224 * 16
    assert megatron_rank_need(str(tiny_model_dir), 2, 2) == dataclasses.replace(need, num_ranks=2)
    assert megatron_rank_need(str(tiny_model_dir), 1, 1).params == 247_872 * 4
    # two data-parallel ranks each hold the whole model: 3.97 MB, where FSDP2's two ranks hold half each
    megatron = dict(training_backend="megatron", num_ranks=2, rank_memory_gb=0.003)
    with pytest.raises(ValueError) as error:
        check_rank_memory(LearnerConfig(**megatron), str(tiny_model_dir))
    for part in ("learner.training_backend = megatron, learner.tensor_parallel = 1", "each rank needs 0.00397 GB",
                 "each of the 2 data-parallel replicas holds a whole TP piece",
                 "No learner.tensor_parallel that divides the attention and key-value heads fits"):  # fmt: skip
        assert part in str(error.value), (part, str(error.value))
    assert check_rank_memory(LearnerConfig(rank_memory_gb=0.003, num_ranks=2), str(tiny_model_dir)) is not None
    kl = check_rank_memory(LearnerConfig(**megatron, tensor_parallel=2), str(tiny_model_dir), reference=True)
    assert kl is not None and kl.reference == 124_224 * 4 and kl.need == 124_224 * 20
    add = str(build_model("add-1m", tmp_path / "add", seed=0))  # 4 heads, 2 key-value heads: TP=2 divides them
    tp1, tp2 = (megatron_rank_need(add, tp, 2).need for tp in (1, 2))
    with pytest.raises(ValueError, match=r"It fits from learner.tensor_parallel = 2 \("):
        check_rank_memory(LearnerConfig(**dict(megatron, rank_memory_gb=(tp1 + tp2) / 2e9)), add)


def test_learner_settings_megatron_does_not_run_are_refused_by_name():
    with pytest.raises(ValueError, match="does not support learner.critic"):
        LearnerConfig(training_backend="megatron", critic=True)
    with pytest.raises(ValueError, match=r"learner.tensor_parallel \(2\) must divide learner.num_ranks \(3\)"):
        LearnerConfig(training_backend="megatron", num_ranks=3, tensor_parallel=2)
    with pytest.raises(ValueError, match="needs learner.training_backend = megatron"):
        LearnerConfig(tensor_parallel=2, num_ranks=2)


def test_an_moe_model_with_tensor_parallelism_is_refused():
    from transformers import AutoConfig

    from asyncrl.learner.megatron.model import transformer_config

    config = AutoConfig.for_model(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, hidden_size=64, num_attention_heads=2
    )
    with pytest.raises(ValueError, match="MoE model needs learner.tensor_parallel = 1"):
        transformer_config(config, 2)


def test_the_kl_to_reference_term_equals_the_fsdp2_one(tiny_model_dir, tmp_path):
    """A reference of other weights (so the KL term is not 0 at the first step), split like the policy."""
    from asyncrl.learner.megatron.state import build_megatron_reference
    from asyncrl.learner.state import build_reference, build_train_state
    from asyncrl.learner.step import RankStep
    from asyncrl.models import build_model

    reference_dir = str(build_model("tiny-0.3m", tmp_path / "reference", seed=1))
    recipe = resolve_recipe("cispo", kl_coef=0.5, kl_estimator="k3")
    batch, cfg, cpu = (
        build_batch(random_groups(num_groups=4, group_size=3, seed=5), recipe),
        LearnerConfig(**CFG),
        torch.device("cpu"),
    )
    fsdp = build_train_state(cfg, str(tiny_model_dir), cpu)
    reference = build_reference(reference_dir, cpu)
    expected = RankStep(fsdp, cfg, recipe, RAW, cpu, lambda t, op="sum": t, reference=reference).accumulate(batch)
    _, step = _megatron(tiny_model_dir)
    reference = build_megatron_reference(reference_dir, 1, cpu)
    ours = dataclasses.replace(step, recipe=recipe, reference=reference).accumulate(batch)
    assert expected.metrics["kl_ref"] > 1e-3  # the term is there
    assert ours.metrics["kl_ref"] == pytest.approx(expected.metrics["kl_ref"], rel=1e-5)
    assert ours.loss == pytest.approx(expected.loss, abs=1e-6)


def test_bf16_compute_is_within_bf16_rounding_of_the_fsdp2_bf16_step(one_rank, tiny_model_dir, mesh):
    """`model.dtype` bfloat16: the decoder layers compute in bf16 on both backends (fp32 masters, embedding, head and
    log-softmax); the two steps differ by bf16 rounding only, as much as bf16 moves either from fp32 (the layers'
    internals round in different places). Measured: loss 0.068718 (megatron bf16), 0.068771 (FSDP2 bf16), 0.068853
    (fp32); gradient norm 1.97564, 1.97523, 1.97594."""
    from asyncrl.learner.megatron.state import build_megatron_train_state, data_parallel_all_reduce
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state

    (fp32, _), _, _ = one_rank
    batch, cfg, cpu = _batch(), LearnerConfig(**CFG), torch.device("cpu")
    fsdp = build_train_state(cfg, str(tiny_model_dir), cpu, lambda m: shard(m, mesh, torch.bfloat16))
    theirs = _step(fsdp, cfg, lambda t, op="sum": t).train([batch], 0)
    mcfg = LearnerConfig(training_backend="megatron", **CFG)
    state = build_megatron_train_state(mcfg, str(tiny_model_dir), cpu, torch.bfloat16)
    ours = _step(state, mcfg, data_parallel_all_reduce).train([batch], 0)
    assert {p.dtype for p in state.policy.parameters()} == {torch.float32}  # fp32 masters
    assert abs(ours.loss - fp32.loss) > 1e-5 and abs(ours.grad_norm - fp32.grad_norm) > 1e-5  # bf16 is in effect
    assert ours.loss == pytest.approx(theirs.loss, rel=2e-3) and ours.grad_norm == pytest.approx(
        theirs.grad_norm, rel=1e-3
    )
    assert ours.metrics["skipped_step"] == 0.0


def test_an_fsdp2_checkpoint_with_a_critic_is_refused_not_converted_without_it(tmp_path):
    """megatron trains no critic: converting a checkpoint that saved one would silently drop it."""
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner.checkpoint import STATE_FILE
    from asyncrl.learner.megatron.switch import to_megatron

    dcp.save({"critic": {"model": {"v_head.weight": torch.zeros(2, 2)}}}, checkpoint_id=str(tmp_path / "ckpt/learner"))
    (tmp_path / "ckpt" / STATE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="holds a critic"):
        to_megatron(str(tmp_path / "ckpt"), str(tmp_path / "out"), "unused", 1)
    assert not (tmp_path / "out").exists()
