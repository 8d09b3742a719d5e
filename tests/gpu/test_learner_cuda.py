"""The learner's step on a CUDA device (NCCL, FSDP2: one rank wrapped with `learner.fsdp: always`, asserted) against
the same step of a plain module on the CPU (gloo), from the same weights and batch: the loss, the gradient norm and
the updated parameters agree; in bf16 the wrapped step agrees with the plain rank's `cast_layers` on the device.
`make test-gpu` runs tests/gpu on a machine with a GPU; elsewhere they are skipped (CI has none). What these tests
check was seen on an H200 and, with the wrapped rank and the bf16 comparison, on an H100 (the dates and figures are
in benchmarks/RESULTS.md, "GPU checks").

No Ray here: the rank's state, sharding and step are built as `LearnerWorker.setup` builds them, in one process
whose default group has a gloo and an NCCL backend (world size 1), so that a CPU mesh and a CUDA mesh both exist.
"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LR = 1e-3


def _groups(vocab: int, num_groups: int = 4, group_size: int = 4, length: int = 24):
    """A GRPO batch with reward variance in every group: every member has a non-zero advantage."""
    from asyncrl.testing import make_trajectory
    from asyncrl.types import Group

    rng, groups = np.random.default_rng(0), []
    for g in range(num_groups):
        members = [
            make_trajectory(
                rng.integers(3, vocab, length), prompt_ids=rng.integers(3, vocab, 8), group_id=f"g{g}", prompt_id=f"p{g}",
                sample_index=i, rollout_logprobs=-rng.random(length) * 3, finish_reason="length", reward=float(i % 2),
            )
            for i in range(group_size)
        ]  # fmt: skip
        groups.append(Group(f"g{g}", members))
    return groups


def _step(model_dir, device: torch.device, compute_dtype: torch.dtype, fsdp: str = "always"):
    """One GRPO step of a freshly built rank state on `device`, FSDP2-wrapped unless `fsdp` is "never" (asserted):
    -> (stats, parameters before, after), on the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import SamplingDistribution
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.policy import shard
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep

    def all_reduce(tensor, op="sum"):
        tensor = tensor.to(device)
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def full(module):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone() for n, p in module.named_parameters()}

    cfg, recipe, mesh = LearnerConfig(lr=LR, warmup_steps=0), resolve_recipe("grpo"), init_device_mesh(device.type, (1,))
    torch.manual_seed(cfg.seed)
    state = build_train_state(cfg, str(model_dir), device, lambda module: shard(module, mesh, compute_dtype, fsdp))
    assert isinstance(state.policy, FSDPModule) == (fsdp == "always")
    before = full(state.policy)
    step = RankStep(state, cfg, recipe, SamplingDistribution(), device, all_reduce)
    vocab = state.policy.causal_lm.config.vocab_size
    stats = step.train([build_batch(_groups(vocab), recipe)], 0)
    return stats, before, full(state.policy)


@pytest.fixture(scope="module")
def cpu_step(process_group, tiny_model_dir):
    return _step(tiny_model_dir, torch.device("cpu"), torch.float32, "never")


def test_an_fp32_step_on_cuda_matches_the_cpu_step(process_group, tiny_model_dir, cpu_step):
    cpu_stats, cpu_before, cpu_after = cpu_step
    stats, before, after = _step(tiny_model_dir, torch.device("cuda", 0), torch.float32)
    assert all(torch.equal(before[n], cpu_before[n]) for n in before)  # the same checkpoint on both
    # the learner's log-probs of the batch (GRPO's loss is 0 at ratio 1: its advantages sum to 0 in each group)
    assert stats.metrics["mismatch_training_ppl"] == pytest.approx(cpu_stats.metrics["mismatch_training_ppl"], rel=1e-4)
    assert stats.grad_norm == pytest.approx(cpu_stats.grad_norm, rel=1e-4)
    moved = max(float((after[n] - before[n]).abs().max()) for n in after)
    assert LR / 2 < moved <= LR * 1.01  # AdamW's first step moves a weight by at most lr
    assert max(float((after[n] - cpu_after[n]).abs().max()) for n in after) < LR / 10


def test_a_bf16_compute_step_on_cuda_stays_near_the_fp32_cpu_step(process_group, tiny_model_dir, cpu_step):
    """Mixed precision as `learner.dtype: bfloat16` runs it: bf16 decoder layers, fp32 master weights and head."""
    cpu_stats, _, _ = cpu_step
    stats, before, after = _step(tiny_model_dir, torch.device("cuda", 0), torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in after.values())
    assert stats.metrics["mismatch_training_ppl"] == pytest.approx(cpu_stats.metrics["mismatch_training_ppl"], rel=0.02)
    assert stats.grad_norm == pytest.approx(cpu_stats.grad_norm, rel=0.05)
    assert max(float((after[n] - before[n]).abs().max()) for n in after) > LR / 2


def test_a_wrapped_bf16_step_on_cuda_matches_the_plain_ranks_cast_layers(process_group, tiny_model_dir):
    """`policy.cast_layers` is FSDP2's `MixedPrecisionPolicy(bf16, fp32)` without FSDP: bit-equal on the CPU
    (tests/unit/learner/test_fsdp.py); on the device, within float rounding of the same kernels."""
    device = torch.device("cuda", 0)
    plain, _, plain_after = _step(tiny_model_dir, device, torch.bfloat16, "never")
    wrapped, _, wrapped_after = _step(tiny_model_dir, device, torch.bfloat16, "always")
    diffs = torch.cat([(wrapped_after[n] - plain_after[n]).abs().flatten() for n in plain_after])
    print(f"bf16 on CUDA, wrapped vs cast_layers: grad norm {wrapped.grad_norm} vs {plain.grad_norm}; "
          f"max |weight diff| {float(diffs.max()):.1e}, {int((diffs > LR / 100).sum())} of {diffs.numel()} over lr / 100")  # fmt: skip
    assert wrapped.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    assert wrapped.metrics["mismatch_training_ppl"] == pytest.approx(plain.metrics["mismatch_training_ppl"], rel=1e-6)
    # Adam's first step is lr * g / (|g| + eps): only where |g| is at rounding level may the two move apart.
    assert float((diffs > LR / 100).float().mean()) < 1e-3
