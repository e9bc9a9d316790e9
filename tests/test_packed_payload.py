"""A native payload's packed copy (weights/packed_payload.py): made beside it, bound to the exact
raw file, decompressed into memory by several threads, refused when damaged."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from sparkrun_coldsnap.errors import IntegrityError
from sparkrun_coldsnap.weights import model_files, packed_payload, weights_memory


def bf16_weights(n_values: int, seed: int = 0) -> bytes:
    """Values as a serving engine holds them: normally distributed, rounded to bf16."""
    f = (np.random.default_rng(seed).standard_normal(n_values, dtype=np.float32) * 0.02).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def small_pieces(monkeypatch):
    # Pieces of 1 MiB and files from 1 MiB: several pieces per test file, and fast.
    monkeypatch.setattr(packed_payload, "CHUNK", 1 << 20)
    monkeypatch.setattr(packed_payload, "SMALLEST", 1 << 20)


@pytest.fixture
def payload(tmp_path, small_pieces):
    d = tmp_path / "payload"
    d.mkdir()
    (d / "rank-0.bin").write_bytes(bf16_weights((5 << 19) + 777))  # not a whole number of pieces
    (d / "rank-0.json").write_text('{"format": 1}')
    return d


def test_a_packed_copy_reads_about_two_thirds_of_the_bytes_and_gives_back_every_one(payload, tmp_path):
    raw = payload / "rank-0.bin"
    index = packed_payload.pack(raw, sha256(raw), threads=3)
    assert index is not None and len(index.pieces) == 6
    assert 0.6 < index.packed_bytes / raw.stat().st_size < 0.75, index.packed_bytes / raw.stat().st_size
    assert packed_payload.packed_path(raw).is_file() and not list(packed_payload.packed_path(raw).parent.glob("*.part"))
    assert packed_payload.usable(raw, raw.stat().st_size, sha256(raw)) == index
    out = tmp_path / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert packed_payload.unpack_into(packed_payload.packed_path(raw), index, fd, threads=4) == raw.stat().st_size
    finally:
        os.close(fd)
    assert out.read_bytes() == raw.read_bytes()
    # the copy is hidden from the payload's own file list
    assert [p.name for p in model_files.model_files(payload)] == ["rank-0.bin", "rank-0.json"]


def test_a_copy_made_from_another_file_is_not_used(payload):
    raw = payload / "rank-0.bin"
    packed_payload.pack(raw, sha256(raw))
    assert packed_payload.usable(raw, raw.stat().st_size, "sha256:" + "0" * 64) is None
    assert packed_payload.usable(raw, raw.stat().st_size + 1, sha256(raw)) is None
    packed_payload.packed_path(raw).write_bytes(b"not a packed file")
    assert packed_payload.usable(raw, raw.stat().st_size, sha256(raw)) is None


def test_bytes_that_do_not_compress_are_not_packed_and_leave_nothing(tmp_path, small_pieces):
    raw = tmp_path / "noise.bin"
    raw.write_bytes(os.urandom(3 << 20))
    assert packed_payload.pack(raw, sha256(raw)) is None
    assert list(packed_payload.packed_path(raw).parent.iterdir()) == []


def test_a_damaged_piece_stops_the_copy_into_memory_and_names_the_piece(payload, tmp_path):
    raw = payload / "rank-0.bin"
    index = packed_payload.pack(raw, sha256(raw))
    assert index is not None
    packed = packed_payload.packed_path(raw)
    offset, length, _ = index.pieces[2]
    with open(packed, "r+b") as f:  # one byte inside piece 2 flipped
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(IntegrityError, match="piece 2 of .* is damaged"):
            packed_payload.unpack_into(packed, index, fd)
    finally:
        os.close(fd)


def test_the_copy_into_memory_takes_the_packed_copy_and_counts_the_bytes_it_read(payload, use_settings, tmp_path):
    use_settings(home=tmp_path / "home")
    raw = payload / "rank-0.bin"
    index = packed_payload.pack(raw, sha256(raw))
    assert index is not None
    files = sorted(payload.iterdir(), key=lambda p: p.name)
    files = [f for f in files if f.is_file()]
    staged = weights_memory.copy_into_memory(files, packed={raw: index})
    try:
        for f in files:
            assert (staged.directory / f.name).read_bytes() == f.read_bytes()
        assert staged.bytes == sum(f.stat().st_size for f in files)
        assert staged.read == index.packed_bytes + (payload / "rank-0.json").stat().st_size
    finally:
        staged.release()


def test_packing_a_payload_skips_what_is_small_and_what_is_already_packed(payload):
    from sparkrun_coldsnap.documents.capsule_config import ModelFile

    files = tuple(ModelFile(name=p.name, size=p.stat().st_size, sha256=sha256(p)) for p in sorted(payload.iterdir()) if p.is_file())
    first = packed_payload.pack_payload(payload, files)
    assert first.files == 1 and first.raw_bytes == (payload / "rank-0.bin").stat().st_size
    made = packed_payload.packed_path(payload / "rank-0.bin").stat().st_mtime_ns
    again = packed_payload.pack_payload(payload, files)
    assert again == first and packed_payload.packed_path(payload / "rank-0.bin").stat().st_mtime_ns == made
    assert 0.6 < first.as_details()["ratio"] < 0.75


def test_decompression_lets_go_of_the_interpreter_lock():
    """The payload's copy decompresses beside the restore's other threads in one process: with the
    lock held through each call they ran at a third of their speed."""
    import blosc2

    assert blosc2.set_releasegil(True) is True  # what importing the module set
