"""A shipped preset unpacks to the same files on another node; equal folders pack to equal bytes."""

from __future__ import annotations

import os

from asyncrl.models.shipping import pack, unpack


def _folder(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_pack_is_deterministic_and_unpack_gives_the_files_back(tmp_path):
    files = {"config.json": b"{}", "tokenizer.json": b"tok", "sub/weights.bin": bytes(range(256))}
    a = _folder(tmp_path / "a", files)
    data = pack(a)
    os.utime(a / "config.json", (0, 12345))  # times do not matter
    assert pack(a) == data
    out = unpack(data, tmp_path / "node2" / "model")
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert not (tmp_path / "node2" / "model.tmp").exists()


def test_unpack_replaces_a_half_unpacked_leftover(tmp_path):
    data = pack(_folder(tmp_path / "a", {"config.json": b"{}"}))
    (tmp_path / "m.tmp").mkdir()
    (tmp_path / "m.tmp" / "junk").write_bytes(b"x")
    out = unpack(data, tmp_path / "m")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
