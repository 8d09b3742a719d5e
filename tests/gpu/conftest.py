"""Fixtures the GPU modules share."""

import pytest
import torch


@pytest.fixture(scope="module")
def process_group():
    """A one-rank process group with gloo for CPU tensors and NCCL for CUDA ones (device 0)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
