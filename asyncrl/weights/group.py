"""The collective transport's wire: one small torch.distributed group per engine, and what travels over it.

Learner rank 0 (`CollectiveSender`) and the vLLM worker of ONE engine (`CollectiveReceiver`) form a group of
world size 2 (sender rank 0), built from a store the sender owns and a `PrefixStore` named by a key the engine
picks (`<engine>-<random>`): no `init_process_group`, so an engine that joins or replaces a dead
one gets its own group and no other group is torn down. Backend: gloo when the staging buffers are on the
CPU, NCCL when they are on CUDA (run on one H200 with the two ranks as two NCCL hosts: benchmarks/RESULTS.md,
"GPU checks"; NCCL refuses two ranks on one GPU, so an engine on the learner's GPU refuses first). The store is a
`FileStore` when every engine is on the sender's node (127.0.0.1): torch's `TCPStore` listens on every
interface whatever host it is given, and nothing here listens beyond loopback unless configured to. Across
nodes it is a `TCPStore` on the learner node's address (which then accepts connections from any host).

The weights travel as one staging buffer laid out like the shared-memory segment (`SegmentLayout`: every
tensor at a 64-byte aligned offset), broadcast in byte ranges of at most `bucket_bytes` cut at tensor
boundaries (`bucket_ranges`). Bytes, not typed tensors: one buffer holds every dtype and each side views
its places as they are. Before a group is built, the engine writes to the store that it joins, or that it
refuses and why (its device does not match the backend, or it is on the learner's GPU); the sender waits for
that at most its timeout (`await_receiver`), because NCCL's set-up, once entered, waits for the other rank
without one. An engine that dies between its word and the set-up can still hold a send there: the next
version's stage then fails after `SEND_WAIT_FACTOR` send timeouts, naming that engine (`_Readers`). Over a
group, in this order:

    at setup    int64 [n], then n bytes of the layout's JSON   (once per group: the receiver caches it)
    each sync   int64 [version, layout digest], then each bucket

The version in the header is the one the sender holds: an engine that asked for v while rank 0 already
staged v + 1 (a joining engine overtaken by the next export) gets v + 1 and says so. The digest checks,
every sync, that both sides still agree on the layout cached at setup.

This module imports only torch (the learner and the vLLM worker processes both use it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from asyncrl.weights.segment import SegmentLayout, process_alive

__all__ = [
    "CollectiveReceiver",
    "CollectiveSender",
    "CollectiveWeights",
    "await_receiver",
    "backend_for",
    "bucket_ranges",
    "connect_store",
    "gpu_identity",
    "open_group",
]

SENDER, RECEIVER = 0, 1
JOIN, JOINING, REFUSED = "join", "joining", "refused"
"""The join handshake's keys in the sender's store, under `<group key>/join/` (`await_receiver`)."""
SEND_WAIT_FACTOR = 3
"""Staging a version waits for the sends still reading the last one at most this many send timeouts (a send
waits for the engine's word, the group's set-up and the broadcasts, each within one timeout)."""
STORE_PREFIX = "asyncrl-weight-store-"
"""Single-node store files: `<tmp>/asyncrl-weight-store-<sender pid>-<random>`."""


@dataclass(frozen=True)
class CollectiveWeights:
    """One version staged on learner rank 0: what reaches the engines through Ray instead of the weights."""

    version: int
    host: str
    """The sender's address: 127.0.0.1 on a single node, else the learner node's IP."""
    store: str
    """Where the groups meet: `file://<path>` (single node) or `tcp://<host>:<port>` (`connect_store`)."""
    backend: str
    """`gloo` or `nccl`: the receiver must stage on the matching device."""
    num_bytes: int
    num_tensors: int
    bucket_bytes: int
    timeout_s: float
    sender: Any = None
    """Learner rank 0's actor handle (Ray): an engine asks it to send (`LearnerWorker.send_collective`)."""
    gpu: str = ""
    """The sender's `gpu_identity` ('' on CPU): an engine on the same GPU refuses before it joins."""

    def to_wire(self, key: str) -> str:
        """JSON for vLLM's RPC (`vllm_compat.WeightReceiver`), with the engine's group key; no actor handle."""
        fields = ("version", "host", "store", "backend", "bucket_bytes", "timeout_s", "gpu")
        return json.dumps({"key": key, **{f: getattr(self, f) for f in fields}})


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors, gloo CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def gpu_identity(device: torch.device) -> str:
    """What NCCL compares when it refuses two ranks of one group on one GPU ("Duplicate GPU detected"): the GPU
    (its UUID, the same in every process whatever its index there: Ray renumbers each actor's GPUs from 0) on the
    host NCCL sees, which is `NCCL_HOSTID` when set. '' on CPU."""
    if device.type != "cuda":
        return ""
    uuid, host = str(torch.cuda.get_device_properties(device).uuid), os.environ.get("NCCL_HOSTID")
    return f"{uuid}@{host}" if host else uuid


def await_receiver(store: dist.Store, key: str, timeout_s: float) -> None:
    """The sender's half of the join handshake: return once the engine of `key` says it joins (its checks passed),
    raise with its reason if it refused, or once `timeout_s` passed. NCCL's communicator set-up has no timeout: a
    sender that entered it for an engine that never comes would wait for ever, holding the staging buffer."""
    handshake, deadline = dist.PrefixStore(f"{key}/{JOIN}", store), time.monotonic() + timeout_s
    while not handshake.check([JOINING]):
        if handshake.check([REFUSED]):
            raise RuntimeError(f"the engine refused to join: {handshake.get(REFUSED).decode()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not join within {timeout_s:g} s")
        time.sleep(0.01)


def bucket_ranges(layout: SegmentLayout, bucket_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the staging buffer, cut at tensor boundaries, each at most `bucket_bytes`
    unless one tensor alone is larger (tensors are never split); padding between tensors travels with them."""
    ranges: list[tuple[int, int]] = []
    for place in layout.places:
        end = place.offset + place.nbytes
        if ranges and end - ranges[-1][0] <= bucket_bytes:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((place.offset, end))
    return ranges


class Group(Protocol):
    """What the wire uses of a c10d backend (`ProcessGroupGloo`, `ProcessGroupNCCL`): torch's type stubs leave
    `broadcast` off their base class `Backend`, which has it."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def shutdown(self) -> None: ...


def open_group(store: dist.Store, key: str, rank: int, backend: str, bind_host: str, timeout_s: float) -> Group:
    """The two-rank group named `key`; blocks until both ranks joined (at most `timeout_s`)."""
    timeout, prefixed = timedelta(seconds=timeout_s), dist.PrefixStore(key, store)
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return cast(Group, dist.ProcessGroupNCCL(prefixed, rank, 2, nccl))
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the runtime name; the stubs say Options
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return cast(Group, dist.ProcessGroupGloo(prefixed, rank, 2, gloo))


def _shut_down(groups: dict[str, Any]) -> None:
    """Shut down every group in `groups` (a dict of groups, or of `_Link`s) and forget them. Both sides run
    it when they are collected or at exit (`weakref.finalize`): a gloo group still open while the interpreter
    finalizes can abort the process ("terminate called without an active exception")."""
    for held in list(groups.values()):
        with contextlib.suppress(Exception):
            getattr(held, "group", held).shutdown()
    groups.clear()


def _broadcast(group: Group, tensors: list[torch.Tensor], timeout_s: float) -> None:
    """Broadcast each tensor from the sender, all in flight at once, and wait for every one."""
    options = dist.BroadcastOptions()
    options.rootRank = SENDER
    works = [group.broadcast([t], options) for t in tensors]
    for work in works:
        work.wait(timedelta(seconds=timeout_s))


class _Readers:
    """Many sends read the staging buffer at once; staging the next version waits until they are done. A send ends
    within its timeouts; one that does not (an engine that died inside NCCL's set-up, which has none) makes the
    stage fail after `wait_s`, naming the engines still being sent to, rather than hold the learner for ever."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._keys: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[None]:
        with self._cond:
            self._keys[key] += 1
        try:
            yield
        finally:
            with self._cond:
                self._keys[key] -= 1
                if not self._keys[key]:
                    del self._keys[key]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, wait_s: float) -> Iterator[None]:
        """Wait until no reader is in (at most `wait_s`), and keep new ones out while the caller writes."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._keys, timeout=wait_s):
                raise TimeoutError(
                    f"sends to {', '.join(sorted(self._keys))} still read the staging buffer after {wait_s:g} s"
                )
            yield


class CollectiveSender:
    """Learner rank 0's side: `stage` copies a version into the staging buffer (layout fixed by the first one);
    `send(key)` broadcasts what is staged over the group `key`, which it opens when the key is new."""

    def __init__(self, host: str, device: torch.device, bucket_bytes: int, timeout_s: float):
        self.host, self.device, self.bucket_bytes, self.timeout_s = host, device, bucket_bytes, timeout_s
        self.gpu = gpu_identity(device)
        self.store, self.address = _serve_store(host, timeout_s)
        if self.address.startswith("file://"):
            weakref.finalize(self, _unlink, self.address.removeprefix("file://"))
        self.layout: SegmentLayout | None = None
        self.version = -1
        self._staging: torch.Tensor | None = None
        self._groups: dict[str, Group] = {}
        self._readers = _Readers()
        weakref.finalize(self, _shut_down, self._groups)

    def stage(self, state: Mapping[str, torch.Tensor], version: int) -> CollectiveWeights:
        if self.layout is None:
            self.layout = SegmentLayout.of(state)
            self._staging = torch.zeros(self.layout.size, dtype=torch.uint8, device=self.device)
        layout, staging = self._staged()
        layout.check(state)
        views = layout.views(staging)
        try:
            with self._readers.exclusive(SEND_WAIT_FACTOR * self.timeout_s):
                for name, tensor in state.items():
                    views[name].copy_(tensor)
                self.version = version
        except TimeoutError as e:
            raise TimeoutError(f"staging version {version}: {e}") from None
        return CollectiveWeights(
            version,
            self.host,
            self.address,
            backend_for(self.device),
            layout.num_bytes,
            len(layout.places),
            self.bucket_bytes,
            self.timeout_s,
            gpu=self.gpu,
        )

    def send(self, key: str) -> int:
        """Broadcast the staged version to the engine of `key`; -> that version. Raises naming the key (the
        engine's name) on a failure or a timeout, and forgets the group: the engine opens a new one."""
        with self._readers.reading(key):
            try:
                group = self._groups[key] if key in self._groups else self._open(key)
                layout, staging = self._staged()
                header = torch.tensor([self.version, layout.digest], dtype=torch.int64, device=self.device)
                buckets = [staging[start:end] for start, end in bucket_ranges(layout, self.bucket_bytes)]
                _broadcast(group, [header, *buckets], self.timeout_s)
                return int(self.version)
            except Exception as e:
                self._groups.pop(key, None)
                raise RuntimeError(
                    f"weight send of version {self.version} to {key} failed: {type(e).__name__}: {e}"
                ) from e

    def _staged(self) -> tuple[SegmentLayout, torch.Tensor]:
        """The layout and the staging buffer, both set by the first `stage`."""
        if self.layout is None or self._staging is None:
            raise RuntimeError("nothing was staged yet")
        return self.layout, self._staging

    def _open(self, key: str) -> Group:
        await_receiver(self.store, key, self.timeout_s)
        group = open_group(self.store, key, SENDER, backend_for(self.device), self.host, self.timeout_s)
        wire = torch.frombuffer(bytearray(json.dumps(self._staged()[0].to_json()).encode()), dtype=torch.uint8).to(
            self.device
        )
        _broadcast(group, [torch.tensor([wire.numel()], dtype=torch.int64, device=self.device)], self.timeout_s)
        _broadcast(group, [wire], self.timeout_s)
        self._groups[key] = group
        return group


@dataclass
class _Link:
    """A receiver's group and what it caches from the setup: the layout and the staging buffer's views."""

    address: str
    """The sender's store: a key reused with a new learner (a restart) opens a new group."""
    group: Group
    layout: SegmentLayout
    staging: torch.Tensor
    views: dict[str, torch.Tensor]


class CollectiveReceiver:
    """An engine worker's side: `receive` takes one version over the group of its key (opened on first use)
    into a staging buffer allocated once, at the group's setup."""

    def __init__(self, device: torch.device):
        self.device = device
        self._links: dict[str, _Link] = {}
        weakref.finalize(self, _shut_down, self._links)

    def receive(self, wire: str) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """`wire`: `CollectiveWeights.to_wire(key)`. -> (the version received, (name, view of the staging
        buffer) of every tensor, valid until the next receive). Raises naming the learner's address on a
        failure, a timeout or a layout digest other than the one cached at setup, and forgets the group (the
        engine opens one under a new key at its next sync)."""
        d = json.loads(wire)
        try:
            link = self._links.get(d["key"])
            if link is None or link.address != d["store"]:
                link = self._open(d)
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            _broadcast(link.group, [header], d["timeout_s"])
            version, digest = header.tolist()
            if digest != link.layout.digest:
                raise ValueError(
                    f"the learner's layout digest is {digest}, the one set up with this group {link.layout.digest}"
                )
            buckets = [link.staging[start:end] for start, end in bucket_ranges(link.layout, d["bucket_bytes"])]
            _broadcast(link.group, buckets, d["timeout_s"])
            return int(version), list(link.views.items())
        except Exception as e:
            self._links.pop(d["key"], None)
            raise RuntimeError(
                f"weight receive from learner {d['store']} as {d['key']} failed: {type(e).__name__}: {e}"
            ) from e

    def _open(self, d: dict) -> _Link:
        """Join the group of `d["key"]` and take the layout the sender sends at setup. The sender learns through its
        store whether this side joins or refuses, and why (`await_receiver`)."""
        store, bind_host = connect_store(d["store"], d["timeout_s"])
        handshake, refusal = dist.PrefixStore(f"{d['key']}/{JOIN}", store), self._refusal(d)
        if refusal:
            handshake.set(REFUSED, refusal)
            raise ValueError(refusal)
        handshake.set(JOINING, "1")
        group = open_group(store, d["key"], RECEIVER, d["backend"], bind_host, d["timeout_s"])
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        _broadcast(group, [size], d["timeout_s"])
        wire = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        _broadcast(group, [wire], d["timeout_s"])
        layout = SegmentLayout.from_json(json.loads(bytes(wire.cpu().numpy())))
        staging = torch.zeros(layout.size, dtype=torch.uint8, device=self.device)
        link = self._links[d["key"]] = _Link(d["store"], group, layout, staging, layout.views(staging))
        return link

    def _refusal(self, d: dict) -> str:
        """Why this side cannot join the sender of `d` ('' when it can)."""
        if d["backend"] != backend_for(self.device):
            return f"the learner sends over {d['backend']}, this engine's weights are on {self.device}"
        if d.get("gpu") and d["gpu"] == gpu_identity(self.device):
            return (
                f"this engine's weights are on the learner's GPU ({d['gpu']}): "
                "NCCL cannot connect two ranks on one GPU; give the engines GPUs of their own, "
                "or set weight_sync.transport to object_store or shared_memory"
            )
        return ""


def _serve_store(host: str, timeout_s: float) -> tuple[dist.Store, str]:
    """The sender's store and its address (`CollectiveWeights.store`): a file on a single node, else TCP."""
    timeout = timedelta(seconds=timeout_s)
    if host == "127.0.0.1":
        _sweep_stores(tempfile.gettempdir())
        fd, path = tempfile.mkstemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
        os.close(fd)
        store = dist.FileStore(path, -1)
        store.set_timeout(timeout)
        return store, f"file://{path}"
    tcp = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return tcp, f"tcp://{host}:{tcp.port}"


def connect_store(address: str, timeout_s: float) -> tuple[dist.Store, str]:
    """A client of the sender's store at `address`, and the local address gloo should listen on."""
    timeout = timedelta(seconds=timeout_s)
    if address.startswith("file://"):
        store = dist.FileStore(address.removeprefix("file://"), -1)
        store.set_timeout(timeout)
        return store, "127.0.0.1"
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout), _local_ip_towards(host, int(port))


def _sweep_stores(folder: str) -> None:
    """Remove the store files of senders that were killed (a learner actor killed at shutdown never unlinks)."""
    for name in os.listdir(folder):
        pid = name.removeprefix(STORE_PREFIX).split("-", 1)[0]
        if name.startswith(STORE_PREFIX) and pid.isdigit() and not process_alive(int(pid)):
            _unlink(os.path.join(folder, name))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _local_ip_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for 127.0.0.1): where gloo listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]
