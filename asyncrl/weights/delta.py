"""Delta weight sync's wire format: only what changed since the version an engine serves.

Learner rank 0 keeps the last version it sent, in the engines' dtype (`DeltaEncoder.base`); each engine keeps
the same state (`DeltaMirror`). A version travels as named tensors (packed into safetensors buckets like a full
export, `weights.buckets`), the first of them a JSON header (`HEADER`, `DeltaHeader`):

    kind "full"    every tensor under its own name (a join, a replacement, a resync, the first sync)
    kind "delta"   only the tensors whose bits changed: a dense one under its own name, or a sparse one as
                   `@idx:<name>` (flat element indices, int32 or int64) + `@val:<name>` (the new values there)

Changes are found bit by bit in the engines' dtype (the tensors viewed as integers of the same width: -0.0,
NaN payloads and bf16 rounding all count exactly), so an engine that applies every delta holds exactly the
bits a full sync would have sent. A tensor goes sparse when its indices and values take fewer bytes than the
tensor: below 1/3 of its elements changed in bf16 (2-byte values, 4-byte indices), 1/2 in fp32.

Digests: a CRC-32 per tensor and, over them, a state digest (`state_digest`). A delta names the state it
applies to (`base_version`, `base_digest`) and the one it yields (`digest`). The mirror refuses a delta whose
base is not what it holds, and checks the digest of what it holds after applying one; either failure raises an
error carrying `BASE_MISMATCH`, on which the transport resends the full state (`weight_sync.delta`).

This module imports only torch (the learner and the vLLM worker processes both use it).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "BASE_MISMATCH",
    "HEADER",
    "DeltaEncoder",
    "DeltaHeader",
    "DeltaMirror",
    "checksum",
    "is_delta_payload",
    "state_digest",
]

HEADER = "@asyncrl-delta"
IDX, VAL = "@idx:", "@val:"
BASE_MISMATCH = "delta base mismatch"
"""In the error an engine raises when a delta does not apply to what it holds (the transport then resends all)."""
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta-sync payload is: its kind, the version and digest it yields, and the base it applies to."""

    kind: str
    """`full` or `delta`."""
    version: int
    digest: str
    base_version: int = -1
    base_digest: str = ""
    changed: int = 0
    """Tensors that changed (all of them for `full`)."""
    sparse: int = 0
    """Of those, sent as indices + values."""

    def to_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(asdict(self)).encode()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> DeltaHeader:
        return cls(**json.loads(bytes(tensor.numpy())))


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (C order)."""
    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def state_digest(checksums: Mapping[str, int]) -> str:
    """A digest of a whole state from its tensors' checksums (names included, order not)."""
    return hashlib.sha256(json.dumps(sorted(checksums.items())).encode()).hexdigest()[:16]


def is_delta_payload(named: Mapping[str, torch.Tensor]) -> bool:
    return HEADER in named


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flat (bit-exact comparison)."""
    flat = tensor.reshape(-1)
    return flat.view(_INTS[flat.element_size()]) if flat.element_size() in _INTS else flat


def _signature(state: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in state.items()]


class DeltaEncoder:
    """Learner rank 0's side: `encode(state, version)` -> the named tensors of that version's payload, full or
    delta against the last one encoded; `full()` -> the payload of the last version in full (for an engine that
    joins, or one that missed a delta)."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, int] = {}
        self.version = -1

    @property
    def digest(self) -> str:
        return state_digest(self.checksums)

    def encode(
        self, state: Mapping[str, torch.Tensor], version: int, full: bool = False
    ) -> list[tuple[str, torch.Tensor]]:
        """`state`: every tensor in the engines' dtype. A full payload when `full`, at the first version, or when
        the names, shapes or dtypes changed; else a delta. The state becomes the base (copied)."""
        if full or not self.base or _signature(state) != _signature(self.base):
            self.base = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
            self.checksums = {name: checksum(t) for name, t in self.base.items()}
            self.version = version
            return self.full()
        base_version, base_digest = self.version, self.digest
        entries, sparse = [], 0
        for name, new in state.items():
            new = new.detach().to("cpu")
            old = self.base[name]
            mask = _bits(old) != _bits(new)
            count = int(mask.sum())
            if count == 0:
                continue
            idx_dtype = torch.int32 if old.numel() < 2**31 else torch.int64
            idx_bytes = torch.empty((), dtype=idx_dtype).element_size()
            old.copy_(new)  # one sequential copy: cheaper than scattering the changed elements
            if count * (idx_bytes + new.element_size()) < new.numel() * new.element_size():
                changed = mask.reshape(-1).nonzero().squeeze(1)  # indices only where they travel
                entries += [(IDX + name, changed.to(idx_dtype)), (VAL + name, old.reshape(-1)[changed])]
                sparse += 1
            else:
                entries.append((name, old))
            self.checksums[name] = checksum(old)
        self.version = version
        changed_names = len(entries) - sparse
        header = DeltaHeader("delta", version, self.digest, base_version, base_digest, changed_names, sparse)
        return [(HEADER, header.to_tensor()), *entries]

    def full(self) -> list[tuple[str, torch.Tensor]]:
        header = DeltaHeader("full", self.version, self.digest, changed=len(self.base))
        return [(HEADER, header.to_tensor()), *self.base.items()]


class DeltaMirror:
    """An engine's side: the state it serves, in the engines' dtype (one copy of the weights in its memory).
    `apply(payload)` -> the header and the names of the tensors that changed (every name for a full payload)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, int] = {}
        self.version = -1
        self.digest = ""
        """'' while the mirror holds nothing trustworthy (never loaded, or a delta failed half applied)."""

    def apply(self, payload: Mapping[str, torch.Tensor]) -> tuple[DeltaHeader, list[str]]:
        header = DeltaHeader.from_tensor(payload[HEADER])
        named = {name: t for name, t in payload.items() if name != HEADER}
        if header.kind == "full":
            self.state, self.digest = dict(named), ""
            names = list(named)
        else:
            if not self.digest or (self.version, self.digest) != (header.base_version, header.base_digest):
                raise RuntimeError(
                    f"{BASE_MISMATCH}: version {header.version} applies to version {header.base_version} "
                    f"({header.base_digest}), this engine holds {self.version} ({self.digest or 'nothing'})"
                )
            self.digest = ""
            names = list(self._apply_delta(named))
        self.checksums.update({name: checksum(self.state[name]) for name in names})
        if header.kind == "full":
            self.checksums = {name: self.checksums[name] for name in self.state}
        digest = state_digest(self.checksums)
        if digest != header.digest:
            raise RuntimeError(
                f"{BASE_MISMATCH}: the state after version {header.version} has digest {digest}, "
                f"the learner's {header.digest}"
            )
        self.version, self.digest = header.version, digest
        return header, names

    def _apply_delta(self, named: Mapping[str, torch.Tensor]) -> Iterator[str]:
        for name, tensor in named.items():
            if name.startswith(VAL):
                continue
            if name.startswith(IDX):
                target = name.removeprefix(IDX)
                self._place(target).view(-1)[tensor.long()] = named[VAL + target]
                yield target
            else:  # the received tensor becomes the held one (no copy)
                held = self._place(name)
                if (held.shape, held.dtype) != (tensor.shape, tensor.dtype):
                    raise RuntimeError(
                        f"{BASE_MISMATCH}: {name!r} is {tuple(tensor.shape)} {tensor.dtype} in the delta, "
                        f"{tuple(held.shape)} {held.dtype} here"
                    )
                self.state[name] = tensor
                yield name

    def _place(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise RuntimeError(f"{BASE_MISMATCH}: the delta changes {name!r}, which this engine does not hold")
        return self.state[name]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.state.items())
