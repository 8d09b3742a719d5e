"""The shared-memory segment: layout arithmetic, a write/read round trip, version slots and stamps."""

import os

import pytest
import torch

from asyncrl.weights.segment import HEADER_BYTES, SegmentLayout, SegmentReader, SegmentWriter, SharedWeights, slot_path


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,  # 24 bytes
        "b.bias": torch.arange(3, dtype=torch.float32) * scale,  # 12 bytes
        "c.weight": torch.ones(4, 4, dtype=torch.bfloat16) * scale,  # 32 bytes
        "d.step": torch.tensor([7], dtype=torch.int64),  # 8 bytes
    }


def test_layout_places_every_tensor_at_a_64_byte_boundary_after_the_header():
    layout = SegmentLayout.of(_state())
    # header 64; a: 64 + 24 -> next at 128; b: 128 + 12 -> 192; c: 192 + 32 -> 256; d: 256 + 8 -> 320
    assert [p.offset for p in layout.places] == [64, 128, 192, 256]
    assert HEADER_BYTES == 64 and layout.size == 320
    assert [(p.name, p.shape, p.dtype) for p in layout.places][2] == ("c.weight", (4, 4), "bfloat16")
    assert layout.num_bytes == 24 + 12 + 32 + 8


def test_layout_check_names_the_tensor_that_no_longer_fits():
    layout = SegmentLayout.of(_state())
    changed = {**_state(), "b.bias": torch.zeros(4)}
    with pytest.raises(ValueError, match="b.bias"):
        layout.check(changed)
    layout.check(_state(2.0))  # same names, shapes and dtypes: fits


def test_versions_alternate_between_two_slots():
    assert slot_path("/r", 6) == "/r-0" and slot_path("/r", 7) == "/r-1" and slot_path("/r", 8) == "/r-0"


def test_a_reader_sees_exactly_what_the_writer_wrote_for_each_version(tmp_path):
    writer, reader = SegmentWriter(str(tmp_path / "w")), SegmentReader()
    first = writer.write(_state(1.0), version=1)
    second = writer.write(_state(3.0), version=2)
    assert first.path != second.path  # version 2 did not touch version 1's slot
    for shared, scale in ((first, 1.0), (second, 3.0)):
        got = dict(reader.tensors(SharedWeights.from_wire(shared.to_wire())))
        for name, tensor in _state(scale).items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    writer.close()
    assert not list(tmp_path.iterdir())


def test_the_same_slot_rewritten_is_seen_through_the_cached_mapping(tmp_path):
    writer, reader = SegmentWriter(str(tmp_path / "w")), SegmentReader()
    dict(reader.tensors(writer.write(_state(1.0), version=1)))
    views = dict(reader.tensors(writer.write(_state(5.0), version=3)))  # slot 1 again
    assert views["b.bias"].tolist() == [0.0, 5.0, 10.0]


def test_a_reader_overtaken_by_a_newer_version_in_its_slot_fails_the_check(tmp_path):
    writer, reader = SegmentWriter(str(tmp_path / "w")), SegmentReader()
    old = writer.write(_state(1.0), version=2)
    reader.tensors(old)
    writer.write(_state(2.0), version=4)  # same slot as 2: a late reader of 2 must not load a mix
    with pytest.raises(RuntimeError, match="holds version 4, not 2"):
        reader.check(old)
    with pytest.raises(RuntimeError, match="holds version 4, not 2"):
        reader.tensors(old)


def test_the_first_write_creates_both_slots_and_the_unwritten_one_holds_no_version(tmp_path):
    writer, reader = SegmentWriter(str(tmp_path / "w")), SegmentReader()
    writer.write(_state(1.0), version=1)  # slot 1; slot 0 is created (pages faulted in) but not written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w-0", "w-1"]
    unwritten = SharedWeights(slot_path(str(tmp_path / "w"), 0), 0, writer.layout)  # zeros must not pass as version 0
    with pytest.raises(RuntimeError, match="holds version -1, not 0"):
        reader.tensors(unwritten)


def test_segment_files_are_private_to_the_user(tmp_path):
    shared = SegmentWriter(str(tmp_path / "w")).write(_state(), version=0)
    assert os.stat(shared.path).st_mode & 0o777 == 0o600


def test_ranks_writing_their_own_rows_fill_the_slot_as_one_full_write_does(tmp_path):
    """Rank 0 creates the slots (the first, full write); another rank maps them (`attach`); each writes its rows of
    every tensor (dim-0 shards, the second rank's possibly empty) between rank 0's `begin` and `finish`."""
    root = str(tmp_path / "seg")
    rank0 = SegmentWriter(root)
    rank0.write(_state(), 1)
    rank1 = SegmentWriter(root)
    rank1.attach(rank0.layout)
    full = _state(2.0)
    rank0.begin(2)
    rank0.write_rows({"a.weight": (0, full["a.weight"][:1]), "b.bias": (0, full["b.bias"][:2]),
                      "c.weight": (0, full["c.weight"][:2]), "d.step": (0, full["d.step"])}, 2)
    rank1.write_rows({"a.weight": (1, full["a.weight"][1:]), "b.bias": (2, full["b.bias"][2:]),
                      "c.weight": (2, full["c.weight"][2:])}, 2)
    shared = rank0.finish(2)
    reader = SegmentReader()
    got = dict(reader.tensors(shared))
    assert all(torch.equal(got[name], tensor) for name, tensor in full.items())
    rank0.begin(4)  # the same slot, being written again: a reader refuses it
    with pytest.raises(RuntimeError, match="holds version -1, not 2"):
        reader.check(shared)
    rank0.close()
