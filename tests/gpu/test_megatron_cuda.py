"""The megatron backend on a CUDA device (NCCL, no CPU shims: `asyncrl.learner.megatron.cpu.apply` declines where CUDA
exists): log-probs equal transformers' on the same device; one step equals the FSDP2 backend's step of a plain module
on the CPU, in fp32 (megatron itself cannot run on the CPU of a CUDA machine: its layers allocate on the current CUDA
device); and megatron's own machinery drives the backend's model and loss: its schedule (`get_forward_backward_func`,
no pipelining) gives the backend's micro-batch loop's loss and gradients, and its optimizer (`get_megatron_optimizer`,
the distributed optimizer over megatron's DDP grad buffers) gives the backend's AdamW step.

Needs megatron-core: `deploy/gpu_check.sh` installs it from a wheel carried in the tree on a GPU machine that lacks it
and runs tests/gpu. Skipped without CUDA or without megatron-core.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("megatron.core")

LR = 1e-3
ADAM_ROUNDING = 2e-2 * LR
"""Two float-rounding-equal gradients may move a weight apart by a fraction of lr in AdamW's first update (where
|g| ~ 1e-8; tests/unit/learner/test_megatron.py)."""


def _batch(recipe):
    from asyncrl.learner.batch import build_batch
    from tests.unit.learner.helpers import random_groups

    return build_batch(random_groups(num_groups=4, group_size=4, seed=2), recipe)


def _megatron(model_dir, device: torch.device, **overrides):
    """(state, RankStep, recipe, config) of the megatron backend on `device`."""
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.megatron.state import build_megatron_train_state, data_parallel_all_reduce
    from asyncrl.learner.step import RankStep

    recipe, cfg = resolve_recipe("grpo"), LearnerConfig(training_backend="megatron", lr=LR, **overrides)
    state = build_megatron_train_state(cfg, str(model_dir), device)
    return state, RankStep(state, cfg, recipe, RAW, device, data_parallel_all_reduce), recipe, cfg


def _step(model_dir, device: torch.device, megatron: bool = True):
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    if megatron:
        state, step, recipe, _ = _megatron(model_dir, device)
        stats = step.train([_batch(recipe)], 0)
        return stats, {k: v.cpu() for k, v in state.policy.full_hf_state().items()}
    recipe, cfg = resolve_recipe("grpo"), LearnerConfig(lr=LR)
    state = build_train_state(cfg, str(model_dir), device)
    stats = RankStep(state, cfg, recipe, RAW, device, lambda t, op="sum": t).train([_batch(recipe)], 0)
    return stats, {k.removeprefix("causal_lm."): v.detach() for k, v in state.policy.named_parameters()}


def test_megatron_cuda_logprobs_equal_transformers(process_group, tiny_model_dir):
    from asyncrl.algo.sampling import RAW
    from asyncrl.learner.megatron.cpu import applied
    from asyncrl.learner.megatron.model import MegatronPolicy, build_gpt, init_parallel
    from asyncrl.learner.policy import PolicyModel, load_causal_lm

    hf = load_causal_lm(str(tiny_model_dir)).cuda()
    init_parallel(1)
    assert not applied()
    policy = MegatronPolicy(build_gpt(hf.config, 1), hf.config).cuda()
    policy.load_hf_state(hf.state_dict())
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), device="cuda")
    mask, positions = torch.ones_like(ids), torch.arange(16, device="cuda").expand(2, 16)
    with torch.no_grad():
        diff = (policy(ids, mask, positions, RAW) - PolicyModel(hf)(ids, mask, positions, RAW))[:, :-1]
    assert float(diff.abs().max()) < 1e-4  # TF32 matmuls may differ between the two implementations


def test_megatron_cuda_step_equals_the_fsdp2_cpu_step(process_group, tiny_model_dir):
    cuda_stats, cuda_weights = _step(tiny_model_dir, torch.device("cuda", 0))
    cpu_stats, cpu_weights = _step(tiny_model_dir, torch.device("cpu"), megatron=False)
    assert cuda_stats.loss == pytest.approx(cpu_stats.loss, abs=1e-4)
    assert cuda_stats.grad_norm == pytest.approx(cpu_stats.grad_norm, rel=1e-3)
    assert max(float((cuda_weights[k] - cpu_weights[k]).abs().max()) for k in cuda_weights) < 1e-4


def _schedule(step, recipe, batch, model) -> float:
    """Forward and backward of every micro-batch of `batch` through megatron's schedule (no pipelining), the loss of
    each the backend's (`compute_policy_loss` on the step's micro-batches, advantages and weights), summed as the
    backend sums them (`calculate_per_token_loss`: megatron divides by nothing); -> the batch loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from asyncrl.algo.recipes import compute_policy_loss

    prepared = step.accumulate(batch, policy=False).batch  # micro-batches and advantages, no forward
    mbs = prepared.micro_batches

    def forward_step(data_iterator, _model):
        i, mb = next(data_iterator)
        learner = step._logprobs(mb)
        mask, weights, (learner, old) = step._supported(mb, mb.token_weights, [learner, learner.detach()])
        loss, _ = compute_policy_loss(
            recipe, learner, old, mb.rollout_logprobs, prepared.advantages[i], mask, weights, mb.group_ids
        )
        one = torch.ones((), dtype=torch.int, device=loss.device)
        return loss, lambda out: (out, one, {"loss": out.detach()})

    model.config.calculate_per_token_loss = True
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(enumerate(mbs)),
        model=model,
        num_microbatches=len(mbs),
        seq_length=0,
        micro_batch_size=0,
        forward_only=False,
    )
    assert len(out) == len(mbs) > 1  # several micro-batches: the reduction across them is exercised
    return float(sum(d["loss"] for d in out))


def test_megatron_schedule_gives_the_backend_loop_loss_and_gradients(process_group, tiny_model_dir):
    cuda = torch.device("cuda", 0)
    state, step, recipe, _ = _megatron(tiny_model_dir, cuda, tokens_per_microbatch=64)
    batch = _batch(recipe)
    expected_loss = step.accumulate(batch).loss
    expected = {n: p.grad.clone() for n, p in state.policy.gpt.named_parameters()}
    state.optimizer.zero_grad(set_to_none=True)
    loss = _schedule(step, recipe, batch, state.policy.gpt)
    assert abs(expected_loss) > 1e-4 and loss == pytest.approx(expected_loss, abs=1e-6)
    grads = {n: p.grad for n, p in state.policy.gpt.named_parameters()}
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # a real gradient
    assert max(float((grads[n] - expected[n]).abs().max()) for n in expected) < 1e-6


def test_megatron_optimizer_step_equals_the_backend_step(process_group, tiny_model_dir):
    """megatron's DDP (grad buffers) + distributed optimizer (torch's AdamW inside without apex or TE) + its global
    norm clip, after its schedule, against `RankStep.train` (the backend's AdamW and clip) from the same weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cuda = torch.device("cuda", 0)
    overrides = dict(tokens_per_microbatch=64, grad_clip=0.05)  # a clip that acts
    ours_state, ours_step, recipe, cfg = _megatron(tiny_model_dir, cuda, **overrides)
    batch = _batch(recipe)
    ours = ours_step.train([batch], 0)
    assert ours.grad_norm > cfg.grad_clip

    state, step, _, _ = _megatron(tiny_model_dir, cuda, **overrides)
    gpt = state.policy.gpt
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1], adam_eps=1e-8, clip_grad=cfg.grad_clip, bf16=False, fp16=False,
            params_dtype=torch.float32, use_distributed_optimizer=True,
        ),
        [model],
    )  # fmt: skip
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _schedule(step, recipe, batch, model)
    model.finish_grad_sync()
    updated, grad_norm, _ = optimizer.step()
    assert updated and loss == pytest.approx(ours.loss, abs=1e-6)
    assert grad_norm == pytest.approx(ours.grad_norm, rel=1e-5)
    theirs, expected = state.policy.full_hf_state(), ours_state.policy.full_hf_state()
    assert max(float((theirs[k] - expected[k]).abs().max()) for k in expected) < ADAM_ROUNDING
    assert max(float((theirs[k] - v).abs().max()) for k, v in _initial(tiny_model_dir).items() if k in theirs) > LR / 2


def _initial(model_dir) -> dict[str, torch.Tensor]:
    from asyncrl.learner.policy import load_causal_lm

    return load_causal_lm(str(model_dir)).state_dict()
