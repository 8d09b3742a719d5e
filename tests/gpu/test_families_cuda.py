"""Every model family's learner forward on a CUDA device, FSDP2-wrapped (`learner.fsdp: always`, one rank, NCCL),
against transformers' own forward of the same checkpoint on the CPU in fp32: the log-probs agree in fp32 (the GPU's
own kernels, not the CPU's), and a bf16 mixed-precision rank stays within bf16's rounding. Skipped without a GPU."""

import pytest
import torch

from asyncrl.algo.sampling import RAW
from asyncrl.models.families import FAMILIES
from tests.families import build_families

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

IDS = torch.tensor([[7, 301, 1500, 22, 919, 64, 1024, 5, 2047, 333, 76, 1800, 12, 640, 98, 1201, 44, 700]])


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()  # the next module makes its own


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return build_families(tmp_path_factory.mktemp("families"))


def _cpu_reference(model_dir) -> torch.Tensor:
    from asyncrl.learner.policy import PolicyModel, load_causal_lm

    with torch.no_grad():
        return PolicyModel(load_causal_lm(str(model_dir)))(IDS, torch.ones_like(IDS), torch.arange(18)[None], RAW)[0, :-1]


def _wrapped_on_cuda(model_dir, mesh, dtype: torch.dtype) -> torch.Tensor:
    from torch.distributed.fsdp import FSDPModule

    from asyncrl.learner.policy import PolicyModel, load_causal_lm, shard

    policy = PolicyModel(load_causal_lm(str(model_dir))).cuda()
    shard(policy, mesh, dtype, "always")
    assert isinstance(policy, FSDPModule)
    ids = IDS.cuda()
    with torch.no_grad():
        return policy(ids, torch.ones_like(ids), torch.arange(18, device="cuda")[None], RAW)[0, :-1].cpu()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_wrapped_family_on_cuda_matches_the_cpu_forward(mesh, family_dirs, name):
    reference = _cpu_reference(family_dirs[name])
    fp32 = float((_wrapped_on_cuda(family_dirs[name], mesh, torch.float32) - reference).abs().max())
    bf16 = float((_wrapped_on_cuda(family_dirs[name], mesh, torch.bfloat16) - reference).abs().max())
    print(f"{name}: max |cuda wrapped - cpu| fp32 {fp32:.2e}, bf16 compute {bf16:.2e}")
    assert fp32 <= 1e-4
    assert bf16 <= 0.1
