"""A layer's tar compressed as independent zstd frames, and read back several frames at once.

One zstd frame decompresses on one core, at about 1 GB/s here: the 2.3 GB of an 8B engine's
process images took 4.6 s to unpack, the longest step of a restore on a node with nothing
prepared. Cut into frames of FRAME bytes of the tar, compressed and decompressed on a pool
of threads (the zstd library lets go of the interpreter lock while it works), the layer
unpacks as fast as its files can be written. The frames' compressed sizes travel in the
layer's annotations, so a reader knows where each begins without scanning.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import BinaryIO

import zstandard

from sparkrun_coldsnap.errors import IntegrityError
from sparkrun_coldsnap.host.threads import ContextPool

FRAME = 16 << 20
#: what a frame may say it holds: more is a damaged or hostile layer, not a reason to allocate
MAX_FRAME = 4 * FRAME


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _per_thread(make: Callable[[], object]) -> Callable[[], object]:
    """One (de)compressor per thread: the library's contexts are not shared between threads."""
    local = threading.local()

    def get() -> object:
        ctx = getattr(local, "ctx", None)
        if ctx is None:
            ctx = local.ctx = make()
        return ctx

    return get


class FramedWriter:
    """A write-only stream: its bytes are cut into FRAME-byte pieces, each compressed as a frame
    of its own (its size in its header) on *threads* threads and written to *out* in order;
    ``sizes`` lists the frames' compressed sizes once it is closed."""

    def __init__(self, out: BinaryIO, *, level: int, threads: int | None = None) -> None:
        self.out = out
        self.sizes: list[int] = []
        self.threads = threads or default_threads()
        self._buf = bytearray()
        self._pending: deque[Future[bytes]] = deque()
        self._pool = ContextPool(self.threads)
        self._compressor = _per_thread(lambda: zstandard.ZstdCompressor(level=level, write_content_size=True))

    def _compress(self, chunk: bytes) -> bytes:
        return self._compressor().compress(chunk)  # type: ignore[attr-defined]

    def _submit(self, chunk: bytes) -> None:
        self._pending.append(self._pool.submit(self._compress, chunk))
        while len(self._pending) > self.threads * 2:  # bounded: a few frames in memory, not the layer
            self._write_one()

    def _write_one(self) -> None:
        data = self._pending.popleft().result()
        self.out.write(data)
        self.sizes.append(len(data))

    def write(self, data: bytes) -> int:
        self._buf += data
        while len(self._buf) >= FRAME:
            self._submit(bytes(self._buf[:FRAME]))
            del self._buf[:FRAME]
        return len(data)

    def flush(self) -> None:
        pass  # frames are written whole, on close

    def close(self) -> None:
        try:
            if self._buf:
                self._submit(bytes(self._buf))
                self._buf.clear()
            while self._pending:
                self._write_one()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def frame_sizes(annotation: str | None, blob_size: int, layer: str) -> list[int]:
    """The frames' sizes from a layer's annotation; refused unless they add up to the blob."""
    try:
        sizes = [int(x) for x in (annotation or "").split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n <= 0 for n in sizes) or sum(sizes) != blob_size:
        raise IntegrityError("layer %s has no usable frame table (its zstd-frames annotation does not add up to its %d bytes): pull or capture it again" % (layer, blob_size))
    return sizes


class FramedReader:
    """A read-only stream of the decompressed bytes of consecutive frames of *sizes* from *src*;
    *src* is read in order on the caller's thread (it may be hashing), and up to *threads*
    frames ahead are decompressed at once."""

    def __init__(self, src: BinaryIO, sizes: list[int], *, threads: int | None = None) -> None:
        self.src = src
        self.threads = threads or default_threads()
        self._sizes = deque(sizes)
        self._ahead: deque[Future[bytes]] = deque()
        self._pool = ContextPool(self.threads)
        self._decompressor = _per_thread(zstandard.ZstdDecompressor)
        self._current = memoryview(b"")
        try:
            for _ in range(self.threads + 1):
                self._read_ahead()
        except BaseException:
            self.close()
            raise

    def _decompress(self, frame: bytes) -> bytes:
        declared = zstandard.frame_content_size(frame)
        if declared < 0 or declared > MAX_FRAME:
            raise zstandard.ZstdError("a frame declares %d bytes, more than a frame holds or none" % declared)
        return self._decompressor().decompress(frame)  # type: ignore[attr-defined]

    def _read_ahead(self) -> None:
        if not self._sizes:
            return
        want = self._sizes.popleft()
        frame = self.src.read(want)
        if len(frame) != want:
            raise EOFError("the layer ends inside a frame")
        self._ahead.append(self._pool.submit(self._decompress, frame))

    def _next_frame(self) -> bool:
        if not self._ahead:
            return False
        self._current = memoryview(self._ahead.popleft().result())
        self._read_ahead()
        return True

    def read(self, n: int = -1) -> bytes:
        parts = []
        while n < 0 or n > 0:
            if not self._current and not self._next_frame():
                break
            take = len(self._current) if n < 0 else min(n, len(self._current))
            parts.append(self._current[:take].tobytes())
            self._current = self._current[take:]
            if n > 0:
                n -= take
        return b"".join(parts)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> FramedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
