"""The weight transport format: safetensors buckets keyed by Hugging Face names."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weights.buckets import bucket_names, hf_named_tensors, pack_buckets, unpack_bucket


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(16, 16, generator=g)),  # 1024 bytes
        ("b.bias", torch.randn(16, generator=g)),  # 64 bytes
        ("c.weight", torch.randn(64, 16, generator=g)),  # 4096 bytes: larger than the bucket below
        ("d.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),  # 128 bytes
        ("e.weight", torch.randn(4, 4, generator=g)),  # 64 bytes
    ]


def test_buckets_round_trip_every_tensor_bit_exactly_with_its_dtype():
    tensors = _tensors()
    buckets = pack_buckets(tensors, bucket_bytes=1 << 20)
    assert len(buckets) == 1
    out = unpack_bucket(buckets[0])
    assert set(out) == {n for n, _ in tensors}
    for name, t in tensors:
        assert out[name].dtype == t.dtype
        assert torch.equal(out[name], t)


def test_bucket_payload_stays_within_the_bound_unless_one_tensor_is_larger():
    tensors = _tensors()
    buckets = pack_buckets(tensors, bucket_bytes=1100)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors}
    # a (1024) + b (64) = 1088 <= 1100 | c (4096) alone | d (128) + e (64) = 192
    # (safetensors orders names inside a bucket by its own rule; buckets themselves keep the input order)
    assert [set(unpack_bucket(b)) for b in buckets] == [{"a.weight", "b.bias"}, {"c.weight"}, {"d.weight", "e.weight"}]
    for data in buckets:
        names = list(unpack_bucket(data))
        payload = sum(sizes[n] for n in names)
        assert payload <= 1100 or len(names) == 1
    assert sorted(bucket_names(buckets)) == sorted(n for n, _ in tensors)


def test_duplicate_names_are_rejected():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="twice"):
        pack_buckets([("x", t), ("x", t)], bucket_bytes=1 << 20)


def test_tied_model_sends_lm_head_explicitly_and_equal_to_the_embedding():
    from transformers import Qwen2ForCausalLM

    from asyncrl.models import PRESETS, qwen2_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(PRESETS["tiny-0.3m"]))
    assert model.config.tie_word_embeddings
    named = dict(hf_named_tensors(model))
    assert "lm_head.weight" in named and "model.embed_tokens.weight" in named
    # Every entry of the model's own checkpoint format is sent, under the same name.
    assert set(named) == set(model.state_dict())

    # Tied tensors share storage; they must still serialize (in one bucket or in two).
    for bucket_bytes in (1 << 30, 1 << 16):
        buckets = pack_buckets(hf_named_tensors(model), bucket_bytes)
        received = {n: t for data in buckets for n, t in unpack_bucket(data).items()}
        assert torch.equal(received["lm_head.weight"], received["model.embed_tokens.weight"])
        for name, tensor in named.items():
            assert torch.equal(received[name], tensor), name


def test_pack_does_not_modify_or_alias_the_source_tensors():
    t = torch.arange(6, dtype=torch.float32)
    (data,) = pack_buckets([("t", t)], bucket_bytes=1 << 20)
    out = unpack_bucket(data)["t"]
    out.add_(1.0)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
