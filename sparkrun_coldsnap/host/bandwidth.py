"""What this machine moves per second on the paths a restore uses, measured, not assumed.

A restore's phases are bounded by a few bandwidths: reading from the disk (a cold node's
weights and capsule), copying out of the page cache (prepared weights), writing into fresh
memory (what ``criu restore`` does for every page: fault, clear, copy) and, on GPUs, host to
device (weights and device state; measured in the engine's interpreter, see
benchmarks/gpu/). The benchmark prints each phase's rate beside these, and the floor they
add up to.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

from sparkrun_coldsnap.host.chunked_read import read_chunks
from sparkrun_coldsnap.host.threads import ContextPool

CHUNK = 64 << 20


def disk_read(path: Path, limit: int = 4 << 30) -> float | None:
    """Bytes per second read from the disk (direct I/O, several readers) from *path*; None
    where its file system has no direct I/O (a tmpfs: no disk to measure)."""
    t = time.monotonic()
    n, direct = read_chunks(path, limit=limit)
    return n / max(time.monotonic() - t, 1e-9) if direct else None


def page_cache_read(path: Path, limit: int = 4 << 30) -> float:
    """Bytes per second copied out of the page cache: *path* read once to cache it, then timed."""
    read_chunks(path, limit=limit, direct=False)
    t = time.monotonic()
    n, _ = read_chunks(path, limit=limit, direct=False)
    return n / max(time.monotonic() - t, 1e-9)


def fresh_memory_write(nbytes: int = 1 << 30, *, threads: int = 1) -> float:
    """Bytes per second written into memory never touched before, by *threads* threads each
    writing its own share (the memory fill's pattern; one thread is CRIU's)."""
    src = ctypes.create_string_buffer(os.urandom(CHUNK), CHUNK)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))  # the view goes at once: only its address is kept
    share = -(-nbytes // threads)

    def write(start: int) -> None:
        # ctypes lets go of the GIL for the copy: the threads fault and copy at once
        for off in range(start, min(start + share, nbytes), CHUNK):
            ctypes.memmove(base + off, src, min(CHUNK, nbytes - off, start + share - off))

    try:
        t = time.monotonic()
        with ContextPool(threads) as pool:
            list(pool.map(write, range(0, nbytes, share)))
        return nbytes / max(time.monotonic() - t, 1e-9)
    finally:
        area.close()


def measure(sample_file: Path | None, *, drop_cache: bool) -> dict[str, float]:
    """The machine's bandwidths in bytes per second; disk and page cache from *sample_file*
    (a large file on the disk restores read from, such as the weights)."""
    from sparkrun_coldsnap.documents import settings
    from sparkrun_coldsnap.weights.page_cache import drop

    out = {"memory_write": fresh_memory_write()}
    threads = settings.current().page_fill_threads
    if threads > 1:
        # what the memory fill after criu restore writes at (criu/page_fill.py)
        out["memory_write_parallel"] = fresh_memory_write(threads=threads)
    if sample_file is not None and sample_file.is_file():
        if drop_cache:
            drop()
        disk = disk_read(sample_file)
        if disk is not None:
            out["disk_read"] = disk
        out["page_cache_read"] = page_cache_read(sample_file)
    return out
