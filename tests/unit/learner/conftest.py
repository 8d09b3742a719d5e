"""Fixtures shared by the learner's unit tests."""

import pytest


@pytest.fixture(scope="module")
def mesh():
    """A one-rank CPU device mesh over a gloo group of one (FSDP2 wraps on it), torn down with the module when this
    fixture made the group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()
