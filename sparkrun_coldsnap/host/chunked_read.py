"""Reading a file in large chunks by several threads, from the disk itself where the file
system allows it (direct I/O: the page cache gets no second copy), else buffered."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

from sparkrun_coldsnap.host.threads import ContextPool

CHUNK = 64 << 20
BLOCK = 4096  # direct reads want offsets, lengths and buffers on block boundaries


def read_chunks(
    path: Path, consume: Callable[[int, memoryview], None] | None = None, *, limit: int | None = None, direct: bool = True, threads: int = 8,
) -> tuple[int, bool]:  # fmt: skip
    """Read *path* (its first *limit* bytes) chunk by chunk, handing each to *consume* with its
    offset; returns the bytes read and whether direct I/O was used."""
    fd_direct = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd_direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass  # tmpfs and some overlays refuse it
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size if limit is None else min(os.fstat(fd).st_size, limit)

        def one(offset: int) -> int:
            n = min(CHUNK, size - offset)
            buf = mmap.mmap(-1, CHUNK)  # page-aligned, as direct reads want
            view, done = memoryview(buf), 0
            try:
                if fd_direct >= 0:
                    try:  # a direct read of the last chunk may stop short of a block boundary
                        done = min(os.preadv(fd_direct, [view[: (n + BLOCK - 1) // BLOCK * BLOCK]], offset), n)
                    except OSError:
                        done = 0
                while done < n:
                    got = os.preadv(fd, [view[done:n]], offset + done)
                    if got <= 0:
                        raise OSError("%s ended at byte %d of %d" % (path, offset + done, size))
                    done += got
                if consume is not None:
                    consume(offset, view[:n])
                return n
            finally:
                view.release()
                buf.close()

        with ContextPool(threads) as pool:
            return sum(pool.map(one, range(0, size, CHUNK))), fd_direct >= 0
    finally:
        os.close(fd)
        if fd_direct >= 0:
            os.close(fd_direct)
