"""Delta weight payloads (`asyncrl.weights.delta`): bit-exact in bf16 and fp32, sparse only where it pays, and a
mirror that refuses a delta it cannot apply. Payloads go through real safetensors buckets, as on the wire."""

import pytest
import torch

from asyncrl.weights.buckets import pack_buckets, unpack_bucket
from asyncrl.weights.delta import BASE_MISMATCH, HEADER, DeltaEncoder, DeltaHeader, DeltaMirror


def wire(entries, bucket_bytes=1 << 12):
    out = {}
    for data in pack_buckets(entries, bucket_bytes):
        out.update(unpack_bucket(data))
    return out


def state(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(40, 30, generator=g).to(dtype), "b": torch.randn(50, generator=g).to(dtype),
            "steps": torch.arange(6, dtype=torch.int64)}


def nudge(s, a_fraction, b_all=True, lr=1e-3, seed=1):
    """A copy of `s` with the first `a_fraction` of `a`'s elements moved (and all of `b` when `b_all`)."""
    out = {k: v.clone() for k, v in s.items()}
    n = int(out["a"].numel() * a_fraction)
    flat = out["a"].view(-1)
    flat[:n] = (flat[:n].float() + lr * (1 + flat[:n].float().abs())).to(flat.dtype)
    if b_all:
        out["b"] = (out["b"].float() + 0.5).to(out["b"].dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mirror_fed_deltas_holds_exactly_the_bits_of_a_full_sync(dtype):
    enc, mirror = DeltaEncoder(), DeltaMirror()
    s = state(dtype)
    mirror.apply(wire(enc.encode(s, 1)))
    for version, fraction in [(2, 0.01), (3, 0.5), (4, 0.01), (5, 0.0), (6, 1.0)]:  # 4: sparse after dense
        s = nudge(s, fraction, b_all=version != 5, seed=version)
        header, names = mirror.apply(wire(enc.encode(s, version)))
        assert header.version == version and mirror.version == version
        for name, tensor in s.items():
            assert torch.equal(mirror.state[name].view(torch.uint8) if tensor.dtype != torch.int64 else mirror.state[name],
                               tensor.view(torch.uint8) if tensor.dtype != torch.int64 else tensor), name
    full = DeltaMirror()
    full.apply(wire(enc.full()))
    assert full.digest == mirror.digest == enc.digest


def test_only_changed_tensors_travel_sparse_below_the_break_even_dense_above():
    """bf16: 2-byte values + 4-byte indices, so sparse pays below 1/3 of a tensor's elements."""
    enc = DeltaEncoder()
    s = state(torch.bfloat16)
    enc.encode(s, 1)
    s = nudge(s, 0.01, lr=0.1)  # 12 of 1200 elements of a (a step bf16 cannot round away); all of b
    payload = dict(enc.encode(s, 2))
    header = DeltaHeader.from_tensor(payload[HEADER])
    assert (header.kind, header.changed, header.sparse, header.base_version) == ("delta", 2, 1, 1)
    assert set(payload) == {HEADER, "@idx:a", "@val:a", "b"}  # `steps` did not change: not sent
    assert payload["@idx:a"].tolist() == list(range(12)) and payload["@idx:a"].dtype == torch.int32
    s = nudge(s, 0.34, b_all=False, lr=0.1)  # 408 of 1200 > 1/3: dense
    assert set(dict(enc.encode(s, 3))) == {HEADER, "a"}


def test_an_unchanged_state_sends_only_the_header_and_keeps_the_digest():
    enc, mirror = DeltaEncoder(), DeltaMirror()
    s = state(torch.float32)
    mirror.apply(wire(enc.encode(s, 1)))
    digest = enc.digest
    payload = enc.encode({k: v.clone() for k, v in s.items()}, 2)
    assert [name for name, _ in payload] == [HEADER]
    assert mirror.apply(wire(payload))[1] == [] and mirror.digest == digest


def test_negative_zero_counts_as_a_change():
    enc, mirror = DeltaEncoder(), DeltaMirror()
    s = {"w": torch.zeros(8)}
    mirror.apply(wire(enc.encode(s, 1)))
    s["w"][3] = -0.0
    mirror.apply(wire(enc.encode(s, 2)))
    assert torch.signbit(mirror.state["w"][3])


def test_a_mirror_that_missed_a_version_refuses_the_next_delta_and_a_full_payload_heals_it():
    enc, mirror = DeltaEncoder(), DeltaMirror()
    s = state(torch.float32)
    mirror.apply(wire(enc.encode(s, 1)))
    enc.encode(nudge(s, 0.1, seed=2), 2)  # never reaches the mirror
    delta = wire(enc.encode(nudge(s, 0.2, seed=3), 3))
    with pytest.raises(RuntimeError, match=f"{BASE_MISMATCH}: version 3 applies to version 2 .* holds 1"):
        mirror.apply(delta)
    mirror.apply(wire(enc.full()))
    assert (mirror.version, mirror.digest) == (3, enc.digest)


def test_a_new_mirror_refuses_a_delta():
    enc = DeltaEncoder()
    enc.encode(state(torch.float32), 1)
    with pytest.raises(RuntimeError, match="holds -1 \\(nothing\\)"):
        DeltaMirror().apply(wire(enc.encode(nudge(state(torch.float32), 0.1), 2)))


def test_a_corrupted_value_fails_the_digest_and_the_next_delta_is_refused():
    enc, mirror = DeltaEncoder(), DeltaMirror()
    s = state(torch.float32)
    mirror.apply(wire(enc.encode(s, 1)))
    delta = wire(enc.encode(nudge(s, 0.01), 2))
    delta["@val:a"][0] += 1.0
    with pytest.raises(RuntimeError, match=f"{BASE_MISMATCH}: the state after version 2 has digest"):
        mirror.apply(delta)
    with pytest.raises(RuntimeError, match=BASE_MISMATCH):
        mirror.apply(wire(enc.encode(nudge(s, 0.02), 3)))


def test_a_changed_layout_is_sent_in_full():
    enc = DeltaEncoder()
    enc.encode(state(torch.float32), 1)
    s = state(torch.float32)
    s["c"] = torch.ones(3)
    header = DeltaHeader.from_tensor(dict(enc.encode(s, 2))[HEADER])
    assert (header.kind, header.changed) == ("full", 4)
