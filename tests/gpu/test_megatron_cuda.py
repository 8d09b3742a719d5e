"""The megatron backend on a CUDA device (NCCL, no CPU shims: `asyncrl.learner.megatron.cpu.apply` declines where CUDA
exists): log-probs equal transformers' on the same device, and one step equals the FSDP2 backend's step of a plain
module on the CPU, in fp32 (megatron itself cannot run on the CPU of a CUDA machine: its layers allocate on the current
CUDA device). Needs megatron-core (`pip install 'asyncrl[megatron]'`); skipped without CUDA.

Not yet run on a GPU machine (none was available when it was written). megatron's own pipeline schedules and
distributed optimizer are not used by the backend yet, so nothing here covers them.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("megatron.core")


def _step(model_dir, device: torch.device, megatron: bool = True):
    from asyncrl.algo.recipes import resolve_recipe
    from asyncrl.algo.sampling import RAW
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.megatron.state import build_megatron_train_state, data_parallel_all_reduce
    from asyncrl.learner.state import build_train_state
    from asyncrl.learner.step import RankStep
    from tests.unit.learner.helpers import random_groups

    recipe = resolve_recipe("grpo")
    cfg = LearnerConfig(training_backend="megatron" if megatron else "fsdp2", lr=1e-3)
    batch = build_batch(random_groups(num_groups=4, group_size=4, seed=2), recipe)
    if megatron:
        state = build_megatron_train_state(cfg, str(model_dir), device)
        stats = RankStep(state, cfg, recipe, RAW, device, data_parallel_all_reduce).train([batch], 0)
        return stats, {k: v.cpu() for k, v in state.policy.full_hf_state().items()}
    state = build_train_state(cfg, str(model_dir), device)
    stats = RankStep(state, cfg, recipe, RAW, device, lambda t, op="sum": t).train([batch], 0)
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
