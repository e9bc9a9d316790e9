"""What this machine moves per second on the paths a restore uses, measured, not assumed.

A restore's phases are bounded by a few bandwidths: reading from the disk (a cold node's
weights and capsule), copying out of the page cache (prepared weights), writing into fresh
memory (what ``criu restore`` does for every page: fault, clear, copy) and, on GPUs, host to
device (weights and device state; measured in the engine's interpreter, see
benchmarks/gpu/). The benchmark prints each phase's rate beside these, and the floor they
add up to.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 64 << 20
ALIGN = 4096


def _read_all(path: Path, limit: int, *, direct: bool, threads: int = 8) -> int:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    try:
        size = min(os.fstat(fd).st_size, limit)
        size -= size % ALIGN

        def one(offset: int) -> int:
            buf = mmap.mmap(-1, CHUNK)  # page-aligned, as direct reads want
            try:
                return os.preadv(fd, [memoryview(buf)[: min(CHUNK, size - offset)]], offset)
            finally:
                buf.close()

        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, range(0, size, CHUNK)))
    finally:
        os.close(fd)


def disk_read(path: Path, limit: int = 4 << 30) -> float:
    """Bytes per second read from the disk (direct I/O, several readers) from *path*."""
    t = time.monotonic()
    n = _read_all(path, limit, direct=True)
    return n / max(time.monotonic() - t, 1e-9)


def page_cache_read(path: Path, limit: int = 4 << 30) -> float:
    """Bytes per second copied out of the page cache: *path* read once to cache it, then timed."""
    _read_all(path, limit, direct=False)
    t = time.monotonic()
    n = _read_all(path, limit, direct=False)
    return n / max(time.monotonic() - t, 1e-9)


def fresh_memory_write(nbytes: int = 1 << 30) -> float:
    """Bytes per second written into memory never touched before (one thread)."""
    src = os.urandom(CHUNK)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        t = time.monotonic()
        for off in range(0, nbytes, CHUNK):
            n = min(CHUNK, nbytes - off)
            area[off : off + n] = src[:n]
        return nbytes / max(time.monotonic() - t, 1e-9)
    finally:
        area.close()


def measure(sample_file: Path | None, *, drop_cache: bool) -> dict[str, float]:
    """The machine's bandwidths in bytes per second; disk and page cache from *sample_file*
    (a large file on the disk restores read from, such as the weights)."""
    from sparkrun_coldsnap.weights.page_cache import drop

    out = {"memory_write": fresh_memory_write()}
    if sample_file is not None and sample_file.is_file():
        if drop_cache:
            drop()
        out["disk_read"] = disk_read(sample_file)
        out["page_cache_read"] = page_cache_read(sample_file)
    return out
