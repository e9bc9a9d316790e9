"""The local OCI layout store: layout, verified reads, atomic publication, damage, disk errors."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest
import zstandard

from sparkrun_coldsnap.capsule import gc, media, zstd_frames
from sparkrun_coldsnap.capsule.pack import pack_unit, unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.errors import IntegrityError, NotFoundError, StoreError


def flip_byte(path: Path, offset: int = 0) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_layout_is_an_oci_image_layout(tmp_path):
    s = CapsuleStore(tmp_path / "s").init()
    assert json.loads((s.root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((s.root / "index.json").read_text())
    assert index["schemaVersion"] == 2 and index["mediaType"] == media.OCI_INDEX and index["manifests"] == []
    d = s.put_bytes(b"hello", "application/octet-stream")
    assert s.blob_path(d.digest) == s.root / "blobs" / "sha256" / d.digest.split(":")[1]
    assert s.read_blob(d) == b"hello"


def test_tag_resolve_untag_and_gc(tmp_path):
    s = CapsuleStore(tmp_path / "s").init()
    cfg = s.put_json({"a": 1}, "application/json")
    manifest = s.put_json({"schemaVersion": 2, "mediaType": media.OCI_MANIFEST, "config": cfg.to_json(), "layers": []}, media.OCI_MANIFEST)
    s.tag("cap:v1", manifest)
    assert s.resolve("cap:v1").descriptor.digest == manifest.digest
    assert s.resolve(manifest.digest[:15]).ref == "cap:v1"
    orphan = s.put_bytes(b"orphan", "application/octet-stream")
    freed = gc.collect(s, apply=True)
    assert [p.name for p, _ in freed.blobs] == [orphan.digest.split(":")[1]] and freed.bytes == len(b"orphan")
    assert not s.has_blob(orphan.digest) and s.has_blob(cfg.digest)
    s.untag("cap:v1")
    with pytest.raises(NotFoundError, match="cap:v1 is not in the store"):
        s.resolve("cap:v1")
    assert len(gc.collect(s, apply=True).blobs) == 2


@pytest.mark.parametrize("offset", [0, 3])
def test_a_flipped_byte_is_caught_on_read(tmp_path, offset):
    s = CapsuleStore(tmp_path / "s").init()
    d = s.put_bytes(b"some blob content", "application/octet-stream")
    flip_byte(s.blob_path(d.digest), offset)
    with pytest.raises(IntegrityError, match="failed verification"):
        s.read_blob(d)


def test_missing_blob_and_wrong_digest(tmp_path):
    s = CapsuleStore(tmp_path / "s").init()
    d = s.put_bytes(b"x", "application/octet-stream")
    s.blob_path(d.digest).unlink()
    with pytest.raises(NotFoundError, match="missing from the store"):
        s.read_blob(d)
    wrong = Descriptor("application/octet-stream", "sha256:" + "0" * 64, 1)
    with pytest.raises(NotFoundError):
        s.read_blob(wrong)
    with pytest.raises(StoreError, match="malformed OCI descriptor"):
        Descriptor.from_json({"mediaType": "x", "digest": "md5:abc", "size": 1})


def _images(tmp_path: Path) -> Path:
    images = tmp_path / "images"
    (images / "coldsnap-shared").mkdir(parents=True)
    (images / "core-1.img").write_bytes(b"core" * 100)
    # Mostly zeros, like an engine's memory: compresses, unpacks sparse.
    with open(images / "pages-1.img", "wb") as f:
        f.write(os.urandom(4096))
        f.seek(8 << 20)
        f.write(b"tail")
    (images / "coldsnap-shared" / "000-psm_x").write_bytes(bytes(1 << 20))
    return images


def test_pack_and_unpack_round_trip_sparse(tmp_path):
    s = CapsuleStore(tmp_path / "s").init()
    images = _images(tmp_path)
    layers = pack_unit(images, "solo", tmp_path)
    assert {l.annotations[media.A_PART] for l in layers} == {"state", "pages"}
    assert all(l.media_type == media.LAYER_TAR_ZSTD_FRAMES for l in layers)  # zeros: compression pays
    for l in layers:
        s.publish_blob_file(l.path, l.digest, l.size)
    out = tmp_path / "out"
    for l in layers:
        unpack_layer(s, l.descriptor(), out)
    for p in images.rglob("*"):
        if p.is_file():
            q = out / "solo" / p.relative_to(images)
            assert q.read_bytes() == p.read_bytes()
    pages = out / "solo" / "pages-1.img"
    assert pages.stat().st_blocks * 512 < pages.stat().st_size // 4  # holes kept


def _published(tmp_path: Path, layers) -> CapsuleStore:
    s = CapsuleStore(tmp_path / "s").init()
    for l in layers:
        s.publish_blob_file(l.path, l.digest, l.size)
    return s


def _unpacked_equal(images: Path, out: Path) -> None:
    for p in images.rglob("*"):
        if p.is_file():
            assert (out / "solo" / p.relative_to(images)).read_bytes() == p.read_bytes(), p


def test_a_layer_of_many_frames_unpacks_byte_for_byte_with_its_holes(tmp_path, monkeypatch):
    monkeypatch.setattr(zstd_frames, "FRAME", 1 << 20)  # many frames, decompressed and written several at once
    images = tmp_path / "images"
    images.mkdir()
    with open(images / "pages-1.img", "wb") as f:
        for i in range(24):  # data and zeros in turns, blocks that cross the frames' edges
            f.write(os.urandom(300_000) if i % 3 else bytes(1 << 20))
    (images / "core-1.img").write_bytes(b"core" * 100)
    layers = pack_unit(images, "solo", tmp_path)
    pages = next(l for l in layers if l.annotations[media.A_PART] == "pages")
    sizes = [int(x) for x in pages.annotations[media.A_FRAMES].split(",")]
    assert len(sizes) > 8 and sum(sizes) == pages.size
    s = _published(tmp_path, layers)
    out = tmp_path / "out"
    for l in layers:
        unpack_layer(s, l.descriptor(), out)
    _unpacked_equal(images, out)
    assert (out / "solo" / "pages-1.img").stat().st_blocks * 512 < (images / "pages-1.img").stat().st_size  # zero blocks stay holes


def test_a_layer_packed_as_one_frame_before_frames_still_unpacks(tmp_path):
    images = _images(tmp_path)
    blob = tmp_path / "old.tar.zst"
    with open(blob, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as z, tarfile.open(fileobj=z, mode="w|") as tar:
        for p in sorted(images.rglob("*")):
            if p.is_file():
                tar.add(str(p), arcname="solo/%s" % p.relative_to(images).as_posix())
    data = blob.read_bytes()
    s = CapsuleStore(tmp_path / "s").init()
    desc = s.put_bytes(data, media.LAYER_TAR_ZSTD)
    unpack_layer(s, desc, tmp_path / "out")
    _unpacked_equal(images, tmp_path / "out")


def _framed_pages(tmp_path: Path):
    layers = pack_unit(_images(tmp_path), "solo", tmp_path)
    return _published(tmp_path, layers), next(l for l in layers if l.annotations[media.A_PART] == "pages")


@pytest.mark.parametrize("table", ["", "12,x", "1,2,3", "-5,10"])
def test_a_frame_table_that_does_not_add_up_is_refused_naming_the_layer(tmp_path, table):
    s, pages = _framed_pages(tmp_path)
    desc = Descriptor(pages.media_type, pages.digest, pages.size, {**pages.annotations, media.A_FRAMES: table})
    with pytest.raises(IntegrityError, match=r"layer sha256:[0-9a-f]{12} has no usable frame table .*: pull or capture it again"):
        unpack_layer(s, desc, tmp_path / "out")


def test_a_frame_that_claims_more_than_a_frame_holds_is_refused(tmp_path):
    huge = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(zstd_frames.MAX_FRAME + 4096))
    s = CapsuleStore(tmp_path / "s").init()
    desc = s.put_bytes(huge, media.LAYER_TAR_ZSTD_FRAMES)
    desc = Descriptor(desc.media_type, desc.digest, desc.size, {media.A_FRAMES: str(desc.size)})
    with pytest.raises(IntegrityError, match="is not a readable tar\\+zstd: a frame declares"):
        unpack_layer(s, desc, tmp_path / "out")


def test_incompressible_layers_stay_plain_tar(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(2 << 20))
    layers = pack_unit(images, "solo", tmp_path)
    assert [l.media_type for l in layers] == [media.LAYER_TAR]


def test_damaged_layer_refused_while_unpacking(tmp_path):
    s = CapsuleStore(tmp_path / "s").init()
    layers = pack_unit(_images(tmp_path), "solo", tmp_path)
    for l in layers:
        s.publish_blob_file(l.path, l.digest, l.size)
    pages = next(l for l in layers if l.annotations[media.A_PART] == "pages")
    flip_byte(s.blob_path(pages.digest), pages.size // 2)
    with pytest.raises(IntegrityError):
        unpack_layer(s, pages.descriptor(), tmp_path / "out")


def test_read_only_store_gives_one_line_error(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(root)], check=True)
    try:
        with pytest.raises(StoreError) as e:
            CapsuleStore(root).init()
        assert "cannot write" in str(e.value) and "writable store" in str(e.value) and "\n" not in str(e.value)
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_full_disk_gives_one_line_error_and_leaves_nothing(tmp_path):
    root = tmp_path / "full"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=True)
    try:
        s = CapsuleStore(root).init()
        with pytest.raises(StoreError, match="no space left"):
            s.put_bytes(os.urandom(1 << 20), "application/octet-stream")
        leftovers = [p for p in root.rglob("*") if p.is_file() and p.name not in ("oci-layout", "index.json", ".lock")]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_the_memory_staging_folder_goes_with_its_last_directory(tmp_path):
    from sparkrun_coldsnap.host import paths

    memory = tmp_path / paths.MEMORY_STAGING
    first, second = paths.new_memory_staging(memory, "restore-"), paths.new_memory_staging(memory, "restore-")
    (first / "pages-1.img").write_bytes(b"x")
    paths.remove_staging(first)
    assert memory.is_dir() and second.is_dir()  # another restore's directory is still in it
    paths.remove_staging(second)
    assert not memory.exists()
    assert paths.new_memory_staging(memory, "restore-").parent == memory  # made again when needed


def test_two_threads_of_one_process_take_the_store_lock_in_turn(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    inside: list[tuple[str, float, float]] = []
    errors: list[BaseException] = []
    first_in = threading.Event()

    def hold(name: str) -> None:
        try:
            if name == "second":
                first_in.wait(10)  # the other thread holds the lock by now
            with store.locked(), store.locked():  # reentrant within one thread
                start = time.monotonic()
                first_in.set()
                time.sleep(0.3)
                inside.append((name, start, time.monotonic()))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=hold, args=(n,)) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(inside) == 2, errors
    (_, _, first_left), (_, second_entered, _) = sorted(inside, key=lambda r: r[1])
    assert first_left <= second_entered, inside  # the second entered only once the first had left


def test_the_store_lock_is_reentrant_through_another_object_for_the_same_store_and_its_file_stays(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    done = threading.Event()

    def nested() -> None:
        with CapsuleStore(tmp_path / "real").locked(), CapsuleStore(tmp_path / "link").locked():
            done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "a nested lock of the same store waited for itself"
    assert (tmp_path / "real" / ".lock").is_file()  # kept after the release: the next holder locks the same file
