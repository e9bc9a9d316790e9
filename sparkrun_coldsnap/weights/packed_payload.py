"""A packed copy of a native weight payload: fewer bytes to read on a node whose disk is the limit.

A node with nothing in memory reads the whole payload from its disk before hydration can
finish (13.9 GB for an ~8B model, about 10 s on a disk of 1.4 GB/s). bf16 weights are not
random bytes: the high byte of each value (sign and most of the exponent) takes about three
of its eight bits, so with the bytes of each value split apart (a byte shuffle) zstd stores
a payload in about 69% of its size. The copy is cut into pieces of CHUNK bytes, each
compressed on its own, so that many threads decompress at once, each straight into its
place in the memory copy hydration reads.

The copy lives beside the payload (``.packed/<file>``, hidden from the payload's own file
list) and is derived from it: the raw files stay the payload's identity, what a capsule
records and what every other reader takes. Each packed file names the raw file it came
from (size and sha256); a copy that does not match is not used.

File layout: the compressed pieces, each padded to a 4 KiB boundary (direct reads want
aligned offsets), then a JSON index (sizes, each piece's place, length and sha256), then a 16-byte trailer: MAGIC and the index's offset.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import blosc2

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.capsule_config import ModelFile
from sparkrun_coldsnap.errors import ColdsnapError, IntegrityError
from sparkrun_coldsnap.host.atomic import fsync_dir
from sparkrun_coldsnap.host.threads import ContextPool
from sparkrun_coldsnap.progress import Progress

# blosc2 keeps the interpreter lock through a call by default. On a node with nothing prepared
# the payload's copy decompresses beside the rest of the restore, in the same process: a
# Python loop beside one thread decompressing pieces ran at a third of its speed alone, and at
# full speed with the lock let go (benchmarks/decompress_lock_probe.py; the capsule's unpacking
# and the memory fill are such threads).
# Process-wide: no codec or filter of this project is written in Python, which would need it.
blosc2.set_releasegil(True)

CHUNK = 16 << 20
ALIGN = 4096
MAGIC = b"CSPACK01"
TRAILER = struct.Struct("<8sQ")
#: where packing is not worth keeping: the copy must save at least this share of the bytes
KEEP_BELOW = 0.9
#: files smaller than this are read as they are
SMALLEST = 64 << 20
#: the element size the shuffle splits by: bf16 and fp16, what serving engines hold
TYPESIZE = 2
DIRNAME = ".packed"
#: threads reading pieces ahead of the decompression: the virtio disks measured read 1.31 GB/s
#: with 8 direct readers in flight and 1.43 GB/s with 32
READERS = 16


def default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def restore_threads() -> int:
    """Decompression threads while a restore runs beside it: half the host's CPUs, which
    still decompress several times faster than the disk reads; with all of them, CRIU and
    the capsule's unpacking waited for cores (on an H100 host `criu restore` took 3.4 s
    instead of 0.9 s, the unpacking 5.9 s instead of 1.6 s)."""
    return max(2, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class Index:
    raw_size: int
    raw_sha256: str
    chunk: int
    pieces: tuple[tuple[int, int, str], ...]  # (offset, length, sha256) in the packed file, piece by piece

    @property
    def packed_bytes(self) -> int:
        return sum(length for _, length, _ in self.pieces)


def packed_path(raw: Path) -> Path:
    return raw.parent / DIRNAME / raw.name


def _compress(view: memoryview, threads: int) -> bytes:
    return bytes(blosc2.compress2(view, codec=blosc2.Codec.ZSTD, clevel=1, filters=[blosc2.Filter.SHUFFLE], typesize=TYPESIZE, nthreads=threads))


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(raw: Path, raw_sha256: str, *, threads: int | None = None, tick: Callable[[int], None] | None = None) -> Index | None:
    """Write the packed copy of *raw* (whose sha256 is *raw_sha256*); None where it would not
    save enough to be worth reading instead (nothing is left behind then, nor on failure)."""
    size = raw.stat().st_size
    if size < SMALLEST:
        return None
    target = packed_path(raw)
    target.parent.mkdir(exist_ok=True)
    part = target.with_name(target.name + ".part")
    pieces: list[tuple[int, int, str]] = []
    try:
        with open(raw, "rb") as src, open(part, "wb") as out:
            m = mmap.mmap(src.fileno(), 0, prot=mmap.PROT_READ)
            view = memoryview(m)
            try:
                # One piece at a time on blosc2's own threads; reading the source ahead is
                # the page cache's job.
                at = 0
                for offset in range(0, size, CHUNK):
                    data = _compress(view[offset : offset + CHUNK], threads or default_threads())
                    out.write(data)
                    out.write(b"\0" * (_padded(len(data)) - len(data)))
                    pieces.append((at, len(data), hashlib.sha256(data).hexdigest()))
                    at += _padded(len(data))
                    if tick:
                        tick(min(CHUNK, size - offset))
            finally:
                view.release()
                m.close()
            index = Index(size, raw_sha256, CHUNK, tuple(pieces))
            if index.packed_bytes > size * KEEP_BELOW:
                part.unlink()
                return None
            out.write(json.dumps({"raw_size": size, "raw_sha256": raw_sha256, "chunk": CHUNK, "pieces": pieces}).encode())
            out.write(TRAILER.pack(MAGIC, at))
            out.flush()
            os.fsync(out.fileno())
        os.rename(part, target)
        fsync_dir(target.parent)
        return index
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def read_index(packed: Path) -> Index:
    """The index of packed file *packed*; IntegrityError when it is not one."""
    try:
        with open(packed, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            if end < TRAILER.size:
                raise IntegrityError("%s is not a packed payload file (too short)" % packed)
            f.seek(end - TRAILER.size)
            magic, at = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC or at > end - TRAILER.size:
                raise IntegrityError("%s is not a packed payload file (no trailer)" % packed)
            f.seek(at)
            meta = json.loads(f.read(end - TRAILER.size - at))
        return Index(int(meta["raw_size"]), str(meta["raw_sha256"]), int(meta["chunk"]), tuple((int(o), int(n), str(d)) for o, n, d in meta["pieces"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise IntegrityError("%s is not a readable packed payload file: %s" % (packed, err)) from err


def usable(raw_name: Path, size: int, sha256: str) -> Index | None:
    """The index of the packed copy of the raw file *raw_name*, when there is one made from
    exactly that file (*size*, *sha256*); None otherwise."""
    packed = packed_path(raw_name)
    if not packed.is_file():
        return None
    try:
        index = read_index(packed)
    except IntegrityError:
        return None
    if index.raw_size != size or index.raw_sha256 != sha256 or index.chunk <= 0 or len(index.pieces) != -(-size // index.chunk):
        return None
    return index


def unpack_into(packed: Path, index: Index, dst_fd: int, *, threads: int | None = None, tick: Callable[[int], None] | None = None) -> int:
    """Decompress *packed* into the file *dst_fd* (sized and written in place: a tmpfs, say);
    returns the bytes written. IntegrityError on a damaged piece.

    Pieces are read (direct I/O where the file system allows it) and checked by a pool of
    readers a few pieces ahead; each is decompressed by blosc2's own threads (one call on
    sixteen of them ran at 8.9 GB/s on the H200 machine), with the interpreter lock let go."""
    os.ftruncate(dst_fd, index.raw_size)
    if index.raw_size == 0:
        return 0
    inner = threads or default_threads()
    dst = mmap.mmap(dst_fd, index.raw_size)
    out = memoryview(dst)
    fd = os.open(packed, os.O_RDONLY)
    fd_direct = -1
    try:
        try:
            fd_direct = os.open(packed, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError):
            pass  # tmpfs and some overlays refuse direct I/O

        def read(i: int) -> mmap.mmap:
            offset, length, digest = index.pieces[i]
            buf = mmap.mmap(-1, _padded(length))  # page-aligned, as direct reads want
            view = memoryview(buf)
            try:
                got = 0
                if fd_direct >= 0:
                    try:
                        got = min(os.preadv(fd_direct, [view], offset), length)
                    except OSError:
                        got = 0
                while got < length:
                    n = os.preadv(fd, [view[got:length]], offset + got)
                    if n <= 0:
                        raise IntegrityError("%s ends inside piece %d" % (packed, i))
                    got += n
                if hashlib.sha256(view[:length]).hexdigest() != digest:
                    raise IntegrityError("piece %d of %s is damaged (its sha256 differs from the index's): pack the payload again" % (i, packed))
            except BaseException:
                view.release()
                buf.close()
                raise
            view.release()
            return buf

        done = 0
        ahead: deque[Future[mmap.mmap]] = deque()
        with ContextPool(READERS) as pool:
            upcoming = iter(range(len(index.pieces)))
            for i in itertools.islice(upcoming, 2 * READERS):
                ahead.append(pool.submit(read, i))
            i = 0
            while ahead:
                buf = ahead.popleft().result()
                nxt = next(upcoming, None)
                if nxt is not None:
                    ahead.append(pool.submit(read, nxt))
                start = i * index.chunk
                want = min(index.chunk, index.raw_size - start)
                try:
                    blosc2.decompress2(memoryview(buf)[: index.pieces[i][1]], dst=out[start : start + want], nthreads=inner)
                except (RuntimeError, ValueError) as err:
                    raise IntegrityError("piece %d of %s does not decompress: %s" % (i, packed, err)) from err
                finally:
                    buf.close()
                done += want
                if tick:
                    tick(want)
                i += 1
        return done
    finally:
        for f in ahead:  # what was read ahead of a failure
            f.cancel()
        os.close(fd)
        if fd_direct >= 0:
            os.close(fd_direct)
        out.release()
        dst.close()


@dataclass(frozen=True)
class Packed:
    files: int  # files with a packed copy (made now or already there)
    raw_bytes: int  # their size as the engine wrote them
    packed_bytes: int  # what a reader of the copies reads instead

    def as_details(self) -> dict[str, float | int]:
        return {"files": self.files, "raw_bytes": self.raw_bytes, "packed_bytes": self.packed_bytes, "ratio": round(self.packed_bytes / self.raw_bytes, 4) if self.raw_bytes else 1.0}


def pack_payload(directory: Path, files: tuple[ModelFile, ...], *, tick: Callable[[int], None] | None = None) -> Packed:
    """Pack each of the payload's *files* in *directory* that is large enough and has no
    usable copy yet; what the payload's packed copies hold afterwards."""
    n = raw = packed = 0
    for f in files:
        path = directory / f.name
        index = usable(path, f.size, f.sha256) or pack(path, f.sha256, tick=tick)
        if index is not None:
            n, raw, packed = n + 1, raw + index.raw_size, packed + index.packed_bytes
    return Packed(n, raw, packed)


def keep_packed(directory: Path, files: tuple[ModelFile, ...], progress: Progress) -> dict[str, object]:
    """Pack a payload just written or pulled (``COLDSNAP_PACKED_PAYLOAD``) and say how it went;
    only a faster path for later restores, so a failure is reported, not raised."""
    if not settings_mod.current().packed_payload:
        return {"skipped": "COLDSNAP_PACKED_PAYLOAD=off"}
    total = sum(f.size for f in files)
    try:
        with progress.transfer("packing the native weight payload", total) as tick:
            return dict(pack_payload(directory, files, tick=tick).as_details())
    except (OSError, ColdsnapError) as err:
        return {"skipped": str(err)}
