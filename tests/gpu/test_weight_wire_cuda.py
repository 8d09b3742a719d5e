"""The collective transport's wire (`weights.group`) over NCCL, between two processes as learner rank 0 and an
engine's worker, on CUDA (skipped without a GPU; `make test-gpu`).

A lent GPU machine has one GPU, and NCCL refuses two ranks on one GPU. Giving each process its own `NCCL_HOSTID`
makes NCCL take them for two hosts, joined by its socket transport on 127.0.0.1: the same wire (group setup, the
layout, the header, the buckets, the version), a slower link. Without that, the engine must refuse with an error
that says why, and the learner's send must fail naming the engine, not hang.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
KEY = "rollout-0-a"
SIDE = """
import faulthandler, os, sys, time, torch
from asyncrl.weights.group import CollectiveReceiver, CollectiveSender

role, folder, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
faulthandler.dump_traceback_later(2 * timeout + 10, exit=True)  # a side stuck past its timeouts says where, and ends
torch.cuda.set_device(0)
device = torch.device("cuda", 0)

def state(scale):
    return {
        "a.weight": torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3) * scale,
        "b.bias": torch.arange(3, dtype=torch.float32, device=device) * scale,
        "c.weight": torch.ones(4, 4, dtype=torch.bfloat16, device=device) * scale,
        "d.step": torch.tensor([7], dtype=torch.int64, device=device),
    }

try:
    if role == "sender":
        sender = CollectiveSender("127.0.0.1", device, 40, timeout)  # 40 bytes: four buckets
        for version, scale in ((1, 1.0), (2, -2.5)):
            wire = sender.stage(state(scale), version).to_wire(sys.argv[4])
            open(f"{folder}/wire.tmp", "w").write(wire)
            os.rename(f"{folder}/wire.tmp", f"{folder}/wire-{version}")
            assert sender.send(sys.argv[4]) == version
            print(f"sender: sent version {version}", file=sys.stderr, flush=True)
        # stay until the engine has it, as a learner (which lives on) does: exiting shuts the group down
        deadline = time.monotonic() + timeout
        while not any(os.path.exists(f"{folder}/{name}") for name in ("2.pt", "receiver.err")) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        receiver = CollectiveReceiver(device)
        for version in (1, 2):
            path, deadline = f"{folder}/wire-{version}", time.monotonic() + timeout
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            got, named = receiver.receive(open(path).read())
            torch.save({"version": got, **{n: t.cpu().clone() for n, t in named}}, f"{folder}/{version}.pt")
            print(f"receiver: got version {got}", file=sys.stderr, flush=True)
except Exception as e:
    open(f"{folder}/{role}.err", "w").write(f"{type(e).__name__}: {e}")
    sys.exit(1)
"""


def _expected(scale: float) -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
        "b.bias": torch.arange(3, dtype=torch.float32) * scale,
        "c.weight": torch.ones(4, 4, dtype=torch.bfloat16) * scale,
        "d.step": torch.tensor([7], dtype=torch.int64),
    }


def _run_pair(folder: Path, timeout_s: float, host_ids: bool) -> dict[str, int]:
    """Start both sides, wait for both (each bounded by its own timeout): -> each side's exit code."""
    procs = {}
    for role in ("sender", "receiver"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if host_ids:
            env |= {"NCCL_HOSTID": f"asyncrl-test-{role}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
        procs[role] = subprocess.Popen([sys.executable, "-c", SIDE, role, str(folder), str(timeout_s), KEY], cwd=ROOT, env=env)
    deadline = time.monotonic() + 2 * timeout_s + 30
    try:
        return {role: p.wait(max(1.0, deadline - time.monotonic())) for role, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_two_versions_cross_nccl_bit_for_bit(tmp_path):
    codes = _run_pair(tmp_path, 60.0, host_ids=True)
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.err")}
    assert codes == {"sender": 0, "receiver": 0}, errors
    for version, scale in ((1, 1.0), (2, -2.5)):
        got = torch.load(tmp_path / f"{version}.pt")
        assert got.pop("version") == version
        assert got.keys() == _expected(scale).keys()
        for name, tensor in _expected(scale).items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (version, name)


def test_an_engine_on_the_learners_gpu_refuses_and_the_send_names_it(tmp_path):
    codes = _run_pair(tmp_path, 10.0, host_ids=False)
    assert codes == {"sender": 1, "receiver": 1}
    received = (tmp_path / "receiver.err").read_text()
    assert f"as {KEY} failed" in received and "on the learner's GPU (" in received
    assert f"weight send of version 1 to {KEY} failed: RuntimeError: the engine refused to join" in (tmp_path / "sender.err").read_text()
