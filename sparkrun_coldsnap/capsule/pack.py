"""Process images to layers and back.

Each launch unit becomes two layers: ``state`` (everything CRIU wrote except
memory pages, plus saved shared-memory files) and ``pages`` (the memory). A
layer is a tar, compressed with zstd only where a sample shows it pays: the
memory of an inference server is mostly zero pages (KV cache, ring buffers),
which compress ~15x and decompress at several GB/s, while random-looking
weights do not compress and would only cost time. Unpacking verifies the
blob digest and writes zero blocks as holes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from sparkrun_coldsnap.capsule import layer_crypto, media
from sparkrun_coldsnap.capsule.jwe import PrivateKey
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.capsule.zstd_frames import FramedReader, FramedWriter, default_threads, frame_sizes
from sparkrun_coldsnap.digests import short
from sparkrun_coldsnap.errors import IntegrityError, StoreError
from sparkrun_coldsnap.host.atomic import explain_os_error
from sparkrun_coldsnap.host.sparse import write_sparse_parallel
from sparkrun_coldsnap.host.threads import ContextPool

SAMPLE = 4 << 20
PAYS_RATIO = 0.8
ZSTD_LEVEL = 3
# tarfile's stream reads and writes in pieces of this size (its default, 10 KiB, costs a
# call into the decompressor per piece)
TAR_BUFFER = 1 << 20

Tick = Callable[[int], None]


@dataclass(frozen=True)
class PackedLayer:
    path: Path
    digest: str
    size: int
    media_type: str
    annotations: dict[str, str]

    def descriptor(self) -> Descriptor:
        return Descriptor(self.media_type, self.digest, self.size, self.annotations)


class _HashingWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.f.write(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


class _CountingReader:
    def __init__(self, f: BinaryIO, tick: Tick | None) -> None:
        self.f = f
        self.tick = tick

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if self.tick and data:
            self.tick(len(data))
        return data

    def close(self) -> None:
        pass  # the blob is its owner's to close


def compression_pays(files: list[Path]) -> bool:
    """Compress a few samples of the largest files; does zstd save >= 20%?"""
    raw = packed = 0
    comp = zstandard.ZstdCompressor(level=1)
    for path in sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:3]:
        size = path.stat().st_size
        with open(path, "rb") as f:
            for offset in {0, max(size // 2 - SAMPLE // 2, 0)}:
                f.seek(offset)
                chunk = f.read(SAMPLE)
                raw += len(chunk)
                packed += len(comp.compress(chunk))
    return raw > 0 and packed / raw < PAYS_RATIO


def _groups(images: Path) -> dict[str, list[Path]]:
    files = sorted(p for p in images.rglob("*") if p.is_file())
    pages = [p for p in files if p.parent == images and p.name.startswith("pages-")]
    state = [p for p in files if p not in set(pages)]
    return {"state": state, "pages": pages}


def pack_unit(images: Path, unit: str, out_dir: Path, *, tick: Tick | None = None) -> list[PackedLayer]:
    """Tar the unit's images into staged layer files under *out_dir*."""
    layers = []
    for part, files in _groups(images).items():
        if not files:
            continue
        out = out_dir / ("%s-%s.tar" % (unit, part))
        annotations = {media.A_UNIT: unit, media.A_PART: part}
        layers.append(pack_files(files, images, unit, out, annotations, types=(media.LAYER_TAR, media.LAYER_TAR_ZSTD_FRAMES), tick=tick))
    return layers


def pack_files(
    files: list[Path], base: Path, prefix: str, out: Path, annotations: dict[str, str], *, types: tuple[str, str], tick: Tick | None = None,
) -> PackedLayer:  # fmt: skip
    """*files* (under *base*) as one staged layer at *out* (``.zst`` added where compression pays),
    each named *prefix*/its path under *base*; *types*: the layer's media type plain and framed."""
    compress = compression_pays(files)
    unpacked = sum(p.stat().st_size for p in files)
    out = out.with_name(out.name + (".zst" if compress else ""))
    try:
        with open(out, "wb") as raw:
            hw = _HashingWriter(raw)
            framed = FramedWriter(hw, level=ZSTD_LEVEL) if compress else None  # type: ignore[arg-type]
            stream: BinaryIO = framed if framed is not None else hw  # type: ignore[assignment]
            with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT, bufsize=TAR_BUFFER) as tar:
                for path in files:
                    arcname = "%s/%s" % (prefix, path.relative_to(base).as_posix())
                    info = tar.gettarinfo(str(path), arcname=arcname)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    info.mtime = 0
                    with open(path, "rb") as f:
                        tar.addfile(info, _CountingReader(f, tick))
            if framed is not None:
                framed.close()
            raw.flush()
            os.fsync(raw.fileno())
    except OSError as err:
        out.unlink(missing_ok=True)  # a half-written layer is nothing anyone can use
        raise StoreError(explain_os_error(err, out)) from err
    return PackedLayer(
        path=out,
        digest="sha256:" + hw.h.hexdigest(),
        size=hw.size,
        media_type=types[1] if framed is not None else types[0],
        annotations={
            media.A_TITLE: out.name,
            **annotations,
            media.A_UNPACKED_SIZE: str(unpacked),
            **({media.A_FRAMES: ",".join(map(str, framed.sizes))} if framed is not None else {}),
        },
    )


def _safe_member(member: tarfile.TarInfo, dest: Path) -> Path:
    """Where *member* may be written under *dest*; anything else is refused before a byte is.

    Restore runs CRIU as root on what it unpacks: a layer may hold only plain files and
    directories with relative names inside *dest* (no absolute paths, no ``..``, no links,
    devices or fifos)."""
    name = member.name
    parts = Path(name).parts
    if not name or name.startswith("/") or ".." in parts or "\0" in name or not (member.isfile() or member.isdir()):
        raise IntegrityError("layer member %r is not a plain relative file or directory: refusing to unpack it" % name)
    return dest / name


def _declared_size(desc: Descriptor) -> int | None:
    value = (desc.annotations or {}).get(media.A_UNPACKED_SIZE)
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise IntegrityError("layer %s declares an unpacked size %r that is not a number" % (desc.digest, value)) from None


def _decompressed(desc: Descriptor, blob: BinaryIO) -> Any:
    """The layer's tar stream, read from *blob*; closed once the tar is read (the blob stays open)."""
    if desc.media_type in media.FRAMED_TYPES:
        return FramedReader(blob, frame_sizes((desc.annotations or {}).get(media.A_FRAMES), desc.size, short(desc.digest)))
    if desc.media_type == media.LAYER_TAR_ZSTD:  # one frame: capsules packed before the frames
        return zstandard.ZstdDecompressor().stream_reader(blob, closefd=False)
    return blob


def unpack_layer(store: CapsuleStore, desc: Descriptor, dest: Path, *, tick: Tick | None = None, keys: list[PrivateKey] | None = None) -> int:
    """Verify and unpack one layer into *dest*; returns bytes written. An encrypted layer is
    decrypted with one of *keys* as it is read: the plaintext exists only as what lands in *dest*."""
    layer_key = None
    if layer_crypto.is_encrypted(desc):
        layer_key = layer_crypto.open_layer_key(desc, keys or [])
        desc = Descriptor(layer_crypto.plain_media_type(desc.media_type), desc.digest, desc.size, desc.annotations)
    if desc.media_type not in (*media.LAYER_TYPES, *media.ENGINE_CACHE_TYPES):
        raise IntegrityError("layer %s has media type %s, not a capsule layer" % (desc.digest, desc.media_type))
    written = 0
    declared = _declared_size(desc)
    if declared is not None:
        # Room first, from what capture recorded: a layer cannot fill the disk half-way into a restore.
        dest.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest).free
        if declared > free:
            raise StoreError("layer %s unpacks to %d bytes, %s has %d free: free space there (or set COLDSNAP_MEMORY_STAGING=off to stage on the store's disk)" % (
                short(desc.digest), declared, dest, free))  # fmt: skip
    members_total = 0
    with store.open_blob(desc) as verified, contextlib.ExitStack() as after:
        counted = _CountingReader(verified, tick)  # type: ignore[arg-type]
        # Decrypted as read; at the ciphertext's end its digest is checked, then the HMAC over it.
        plain = layer_crypto.DecryptingReader(counted, layer_key, desc.digest) if layer_key is not None else None  # type: ignore[arg-type]
        if plain is not None:
            after.callback(plain.close)
        blob: Any = plain if plain is not None else verified  # what is read to its end to check it
        try:
            source = _decompressed(desc, plain if plain is not None else counted)  # type: ignore[arg-type]
            with contextlib.closing(source), ContextPool(default_threads()) as writers, tarfile.open(fileobj=source, mode="r|", bufsize=TAR_BUFFER) as tar:
                for member in tar:
                    target = _safe_member(member, dest)
                    members_total += max(member.size, 0)
                    if declared is not None and members_total > declared:
                        raise IntegrityError("layer %s holds more than the %d bytes its manifest declares (member %r): refusing to unpack it" % (
                            short(desc.digest), declared, member.name))  # fmt: skip
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    data = tar.extractfile(member)
                    assert data is not None
                    # A new file, never through a link: a name given twice or a planted link is refused.
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        written += write_sparse_parallel(data, fd, member.size, writers)  # type: ignore[arg-type]
                    finally:
                        os.close(fd)
                    os.chmod(target, member.mode & 0o755)  # no setuid/setgid, nothing for others to write
        except FileExistsError as err:
            raise IntegrityError("layer %s names %s twice: refusing to unpack it" % (short(desc.digest), err.filename)) from err
        except NotADirectoryError as err:  # a member under a name an earlier member made a file
            raise IntegrityError("layer %s puts %s under a file: refusing to unpack it" % (short(desc.digest), err.filename)) from err
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as err:
            blob.verify_rest()  # a damaged blob is the likelier story: say so if it is
            raise IntegrityError("layer %s is not a readable tar%s: %s" % (desc.digest, "" if desc.media_type in (media.LAYER_TAR, media.ENGINE_CACHE_TAR) else "+zstd", err)) from err
        blob.verify_rest()
    return written
