"""Reading weight files into the page cache during preparation, before the old workload stops.

Hydration after a restore reads the whole model (or the native payload) once more. Read
from disk that is the largest part of a restore (on the H200 machines about 1.6 GB/s, so
8.4 s of a 12.9 s restore of an ~8B model). Preparation already runs while the old
workload still serves, so it reads the files once there, and hydration then copies them
from memory. Only when they fit well within the memory available: page cache is given
back under pressure, and a prefetch that evicts itself buys nothing.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from sparkrun_coldsnap.errors import ToolError

READ = 16 << 20  # bytes per read call
RANGE = 256 << 20  # bytes per task: a large file is read by several threads at once
READERS = 8
#: the share of MemAvailable the files may take
SHARE = 0.5


def drop() -> None:
    """Write back and drop the page cache (benchmarks start every sample from the disk)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        raise ToolError("cannot drop the page cache (%s): run the benchmark as root, or pass --keep-page-cache" % err.strerror) from err


def switched_off() -> bool:
    return os.environ.get("COLDSNAP_WEIGHTS_CACHE", "auto").lower() in ("0", "off", "no", "false")


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (0 when unknown: nothing is then read ahead)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(frozen=True)
class Plan:
    files: tuple[Path, ...]
    total: int
    available: int

    @property
    def fits(self) -> bool:
        return self.total <= self.available * SHARE

    def why_not(self) -> str:
        return "%.1f GB of weights, %.1f GB of memory available (at most half of it is used)" % (self.total / 1e9, self.available / 1e9)


def plan(files: Sequence[Path], meminfo: Path = Path("/proc/meminfo")) -> Plan:
    return Plan(tuple(files), sum(f.stat().st_size for f in files), memory_available(meminfo))


def read_ahead(files: Sequence[Path], tick: Callable[[int], None] | None = None) -> int:
    """Read every file once, in ranges spread over a few threads (one large file is the usual
    case: a native payload), so the kernel keeps them cached; returns the bytes read."""
    fds: list[int] = []
    local = threading.local()

    def one(task: tuple[int, int, int]) -> int:
        fd, offset, length = task
        if not hasattr(local, "buf"):
            local.buf = bytearray(READ)
        view, done = memoryview(local.buf), 0
        while done < length:
            n = os.preadv(fd, [view[: min(READ, length - done)]], offset + done)
            if n <= 0:
                break  # the file shrank meanwhile: hydration will say so
            done += n
            if tick:
                tick(n)
        return done

    try:
        tasks = []
        for f in files:
            fds.append(fd := os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            size = os.fstat(fd).st_size
            tasks += [(fd, off, min(RANGE, size - off)) for off in range(0, size, RANGE)]
        with ThreadPoolExecutor(READERS) as pool:
            return sum(pool.map(one, tasks))
    finally:
        for fd in fds:
            os.close(fd)
