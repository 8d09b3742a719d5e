"""Probe vLLM 0.32's weight-transfer engines (`vllm/distributed/weight_transfer`) on this build: which can even be
constructed, and what they do on a CPU-only torch. The evidence behind docs/weight_sync.md, "vLLM's weight-transfer
engines". Prints one line per engine; writes nothing.

    python benchmarks/vllm_weight_transfer_probe.py
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import common  # benchmarks/common.py: a script's own folder is on sys.path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt(label: str, probe: Callable[[], str]) -> None:
    try:
        print(f"{label}: {probe()}")
    except BaseException as e:  # noqa: BLE001 -- the failure is the finding
        print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def nccl() -> str:
    """`nccl` and `sparse_nccl` send over vLLM's `PyNcclCommunicator`."""
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host="127.0.0.1", port=_port(), rank=0, world_size=1)
    communicator = PyNcclCommunicator(group, device=torch.device("cpu"))
    tensor = torch.zeros(4)
    result = communicator.broadcast(tensor, src=0)
    return f"constructed with available={communicator.available}, disabled={communicator.disabled}; broadcast -> {result!r}"


def ipc() -> str:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    IPCTrainerWeightTransferEngine(client=None, source=None)  # type: ignore[arg-type]
    return "constructed"


def m2n() -> str:
    import nccl.m2n  # noqa: F401  # type: ignore[import-not-found]

    return "nccl.m2n importable"


def nixl() -> str:
    import nixl as _  # noqa: F401  # type: ignore[import-not-found]

    return "nixl importable"


def main() -> None:
    common.set_runtime_env()
    import torch

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    attempt("nccl / sparse_nccl (PyNcclCommunicator on cpu)", nccl)
    attempt("ipc (IPCTrainerWeightTransferEngine)", ipc)
    attempt("nccl_m2n (the nccl.m2n module)", m2n)
    attempt("sharded_rdt (its NIXL tensor transport)", nixl)


if __name__ == "__main__":
    main()
