"""The collective transport's wire: bucket arithmetic, the layout's digest, and a real two-process gloo exchange
(this process sends as learner rank 0, a subprocess receives as an engine worker)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.weights.group import CollectiveReceiver, CollectiveSender, backend_for, bucket_ranges
from asyncrl.weights.segment import SegmentLayout

ROOT = Path(__file__).resolve().parents[3]


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,  # 24 bytes at 64
        "b.bias": torch.arange(3, dtype=torch.float32) * scale,  # 12 bytes at 128
        "c.weight": torch.ones(4, 4, dtype=torch.bfloat16) * scale,  # 32 bytes at 192
        "d.step": torch.tensor([7], dtype=torch.int64),  # 8 bytes at 256
    }


def test_buckets_are_byte_ranges_cut_at_tensor_boundaries():
    layout = SegmentLayout.of(_state())
    # tensors end at 88, 140, 224, 264: with 100 bytes a bucket, a and b (64..140 = 76 bytes) share one,
    # c would make it 160 bytes: a new bucket 192..264 (72 bytes) takes c and d.
    assert bucket_ranges(layout, 100) == [(64, 140), (192, 264)]
    assert bucket_ranges(layout, 1) == [(64, 88), (128, 140), (192, 224), (256, 264)]  # one tensor each, never split
    assert bucket_ranges(layout, 76) == [(64, 140), (192, 264)]  # a and b fit exactly
    assert bucket_ranges(layout, 75) == [(64, 88), (128, 140), (192, 264)]  # one byte short: b starts a bucket
    assert bucket_ranges(layout, 1 << 20) == [(64, 264)]


def test_the_layout_survives_its_json_and_its_digest_changes_with_any_shape():
    layout = SegmentLayout.of(_state())
    assert SegmentLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    assert SegmentLayout.of(_state(3.0)).digest == layout.digest  # values do not count
    assert SegmentLayout.of({**_state(), "b.bias": torch.zeros(4)}).digest != layout.digest
    assert -(2**63) <= layout.digest < 2**63  # fits the int64 header


def test_the_backend_follows_the_device():
    assert backend_for(torch.device("cpu")) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"


def test_the_nccl_branch_builds_a_two_rank_nccl_group_under_the_engines_prefix(monkeypatch):
    """Structure only: this CPU build has no NCCL, so a stand-in records what the group is built from."""
    import torch.distributed as dist

    from asyncrl.weights.group import open_group

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            self.store, self.rank, self.size, self.timeout = store, rank, size, options._timeout

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = open_group(dist.HashStore(), "rollout-0-ab", 1, "nccl", "unused", 7.0)
    assert (type(group), group.rank, group.size, group.timeout.total_seconds()) == (FakeNCCL, 1, 2, 7.0)
    assert isinstance(group.store, dist.PrefixStore)


def test_a_receiver_on_the_wrong_device_refuses_through_the_senders_store():
    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 5.0)
    record = dataclasses.replace(sender.stage(_state(), 1), backend="nccl")
    with pytest.raises(RuntimeError, match="sends over nccl, this engine's weights are on cpu"):
        CollectiveReceiver(torch.device("cpu")).receive(record.to_wire("rollout-0-x"))
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="to rollout-0-x failed: RuntimeError: the engine refused to join: the learner sends over nccl"):
        sender.send("rollout-0-x")
    assert time.monotonic() - began < 1.0  # told, not timed out


def test_a_sender_whose_engine_never_joins_fails_after_its_timeout_naming_it():
    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 0.3)
    sender.stage(_state(), 1)
    with pytest.raises(RuntimeError, match=r"version 1 to rollout-9-z failed: TimeoutError: the engine did not join within 0.3 s"):
        sender.send("rollout-9-z")


def test_a_send_that_never_ends_fails_the_next_stage_naming_the_engine():
    """A send ends within its timeouts, except one inside NCCL's set-up (which has none): the next version's stage
    must then fail naming the engine, not wait for ever for the staging buffer."""
    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 0.1)
    sender.stage(_state(), 1)
    with sender._readers.reading("rollout-3-c"):  # a send stuck where no timeout reaches it
        with pytest.raises(TimeoutError, match=r"staging version 2: sends to rollout-3-c still read the staging buffer after 0.3 s"):
            sender.stage(_state(2.0), 2)
        assert sender.version == 1
    assert sender.stage(_state(2.0), 2).version == 2  # once it ends, staging goes on


def test_an_engine_on_the_learners_gpu_refuses_before_it_joins(monkeypatch):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on an H200: benchmarks/RESULTS.md) with an
    error that names neither side's role, after the sender entered a set-up that has no timeout. The receiver
    compares GPU identities first; a stand-in gives this CPU build's devices one."""
    from asyncrl.weights import group

    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 5.0)
    monkeypatch.setattr(group, "backend_for", lambda device: "nccl")
    monkeypatch.setattr(group, "gpu_identity", lambda device: "GPU-1234")
    record = dataclasses.replace(sender.stage(_state(), 1), gpu="GPU-1234")
    assert json.loads(record.to_wire("rollout-0-x"))["gpu"] == "GPU-1234"
    with pytest.raises(RuntimeError, match=r"on the learner's GPU \(GPU-1234\).*weight_sync.transport"):
        CollectiveReceiver(torch.device("cpu")).receive(record.to_wire("rollout-0-x"))
    with pytest.raises(RuntimeError, match=r"refused to join: this engine's weights are on the learner's GPU"):
        sender.send("rollout-0-x")


def test_the_gpu_identity_is_the_one_nccl_compares(monkeypatch):
    """NCCL's host is NCCL_HOSTID when set: processes with different ones may share a GPU (tests/gpu does)."""
    from asyncrl.weights.group import gpu_identity

    class Properties:
        uuid = "44e51268-0f85"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    assert gpu_identity(torch.device("cuda", 0)) == "44e51268-0f85" and gpu_identity(torch.device("cpu")) == ""
    monkeypatch.setenv("NCCL_HOSTID", "node-b")
    assert gpu_identity(torch.device("cuda", 0)) == "44e51268-0f85@node-b"


def test_a_cpu_sender_names_no_gpu():
    assert CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 5.0).stage(_state(), 1).gpu == ""


def test_staging_a_state_that_no_longer_fits_names_the_tensor():
    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 5.0)
    sender.stage(_state(), 1)
    with pytest.raises(ValueError, match="b.bias"):
        sender.stage({**_state(), "b.bias": torch.zeros(4)}, 2)


RECEIVER = """
import sys, torch
from asyncrl.weights.group import CollectiveReceiver
receiver = CollectiveReceiver(torch.device("cpu"))
for i, wire in enumerate(sys.argv[2:]):
    try:
        version, named = receiver.receive(wire)
        torch.save({"version": version, **{n: t.clone() for n, t in named}}, f"{sys.argv[1]}/{i}.pt")
    except Exception as e:
        open(f"{sys.argv[1]}/{i}.err", "w").write(str(e))
"""


def _receiver(tmp_path, wires: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER, str(tmp_path), *wires], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _host_ip() -> str:
    """An address other than 127.0.0.1 (127.0.1.1 on some hosts): the sender then serves a TCP store."""
    import socket

    return socket.gethostbyname(socket.gethostname())


@pytest.mark.parametrize("host", ["127.0.0.1", "host"])
def test_two_processes_exchange_two_versions_bit_for_bit_over_gloo(tmp_path, host):
    host = _host_ip() if host == "host" else host
    sender = CollectiveSender(host, torch.device("cpu"), 40, 60.0)  # 40 bytes: 4 buckets
    first = sender.stage(_state(1.0), 1)
    assert first.store.startswith("file://" if host == "127.0.0.1" else f"tcp://{host}:")
    receiver = _receiver(tmp_path, [first.to_wire("rollout-0-a")] * 2)  # the receiver reports what the header says
    assert sender.send("rollout-0-a") == 1  # opens the group, sends the layout, then version 1
    sender.stage(_state(-2.5), 2)
    assert sender.send("rollout-0-a") == 2  # the same group, the cached layout
    assert receiver.wait(60) == 0
    for i, scale in ((0, 1.0), (1, -2.5)):
        got = torch.load(tmp_path / f"{i}.pt")
        assert got.pop("version") == i + 1
        assert got.keys() == _state().keys()
        for name, tensor in _state(scale).items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_header_whose_layout_digest_differs_from_the_setup_fails_the_receive(tmp_path):
    from asyncrl.weights.group import _broadcast

    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 60.0)
    record = sender.stage(_state(), 1)
    receiver = _receiver(tmp_path, [record.to_wire("rollout-1-b")] * 2)
    sender.send("rollout-1-b")
    _broadcast(sender._groups["rollout-1-b"], [torch.tensor([2, sender.layout.digest + 1])], 60.0)  # a stray header
    assert receiver.wait(60) == 0
    error = (tmp_path / "1.err").read_text()
    assert f"{record.store} as rollout-1-b" in error and f"layout digest is {sender.layout.digest + 1}" in error


def test_a_single_node_sender_meets_its_engines_in_a_file_it_removes():
    """No TCP store on a single node (torch's listens on every interface); the file goes with the sender."""
    import gc

    sender = CollectiveSender("127.0.0.1", torch.device("cpu"), 1 << 20, 5.0)
    path = sender.stage(_state(), 1).store.removeprefix("file://")
    assert os.path.exists(path)
    del sender
    gc.collect()
    assert not os.path.exists(path)


def test_the_store_file_of_a_killed_sender_is_swept_by_the_next_one(tmp_path):
    from asyncrl.weights.group import STORE_PREFIX, _sweep_stores

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan, ours = tmp_path / f"{STORE_PREFIX}{dead.stdout.strip()}-ab", tmp_path / f"{STORE_PREFIX}{os.getpid()}-cd"
    other = tmp_path / "unrelated-1-ef"
    for path in (orphan, ours, other):
        path.write_text("")
    _sweep_stores(str(tmp_path))
    assert not orphan.exists() and ours.exists() and other.exists()


def test_after_a_learner_resize_an_engine_opens_a_group_with_the_new_rank_0_over_gloo(tmp_path):
    """A resize replaces rank 0: the engine's next record keeps its key but names the new rank 0's store
    (`CollectiveSync.rewire`), and the engine leaves the old group for one with the new sender."""
    import gc

    from asyncrl.weights.group import _shut_down

    old = CollectiveSender("127.0.0.1", torch.device("cpu"), 40, 60.0)
    new = CollectiveSender("127.0.0.1", torch.device("cpu"), 40, 60.0)
    served = old.stage(_state(1.0), 3)
    new.stage(_state(1.0), 3)  # the rewire: the new rank 0 stages the version the engines serve ...
    after = new.stage(_state(-2.5), 4)  # ... and the next publication is staged there
    assert served.store != after.store
    receiver = _receiver(tmp_path, [served.to_wire("rollout-0-a"), after.to_wire("rollout-0-a")])
    assert old.send("rollout-0-a") == 3
    _shut_down(old._groups)  # the old ranks are stopped
    del old
    gc.collect()
    assert new.send("rollout-0-a") == 4  # opens a new group: the engine joined the new store
    assert receiver.wait(60) == 0
    for i, (version, scale) in enumerate(((3, 1.0), (4, -2.5))):
        got = torch.load(tmp_path / f"{i}.pt")
        assert got.pop("version") == version, (tmp_path / f"{i}.err").read_text() if (tmp_path / f"{i}.err").exists() else ""
        for name, tensor in _state(scale).items():
            assert torch.equal(got[name], tensor), name
