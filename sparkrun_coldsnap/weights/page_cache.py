"""Reading weight files into the page cache during preparation, before the old workload stops.

Hydration after a restore reads the whole model (or the native payload) once more. Read
from disk that is the largest part of a restore (on the H200 machines about 1.6 GB/s, so
8.4 s of a 12.9 s restore of an ~8B model). Preparation already runs while the old
workload still serves, so it reads the files once there, and hydration then copies them
from memory. Only when they fit well within the memory available: page cache is given
back under pressure, and a prefetch that evicts itself buys nothing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.weights import weight_paths

if TYPE_CHECKING:
    from sparkrun_coldsnap.capsule.config import CapsuleConfig
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.progress import Progress
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

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


def memory_available() -> int:
    """MemAvailable in bytes."""
    return int(psutil.virtual_memory().available)


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


def plan(files: Sequence[Path], available: int | None = None) -> Plan:
    """Whether *files* fit in the memory *available* (default: this host's MemAvailable)."""
    return Plan(tuple(files), sum(f.stat().st_size for f in files), memory_available() if available is None else available)


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


def cache_for_restore(
    cfg: CapsuleConfig, choice: WeightChoice, model_dir: str | None, rb: ReceiptBuilder, progress: Progress, *, enabled: bool = True,
) -> WeightChoice:  # fmt: skip
    """Read the files hydration will read into the page cache now, while the old workload still
    serves; the choice comes back marked ``cached`` when they were read."""
    if not enabled:
        rb.details["weights_cache"] = {"skipped": "COLDSNAP_WEIGHTS_CACHE=off"}
        return choice
    files = weight_paths.files_to_read(cfg, choice, model_dir)
    if not files:
        return choice
    t = time.monotonic()
    try:
        p = plan(files)
        if not p.fits:
            rb.details["weights_cache"] = {"skipped": p.why_not()}
            return choice
        with rb.phase("prepare.weights_cache"), progress.transfer("reading %d weight file(s) into the page cache" % len(files), p.total) as tick:
            read = read_ahead(files, tick)
    except OSError as err:  # only a head start: hydration reads the files itself and reports what is wrong
        rb.details["weights_cache"] = {"skipped": "reading %s failed: %s" % (err.filename or "a weight file", err.strerror)}
        return choice
    rb.details["weights_cache"] = {"bytes": read, "seconds": round(time.monotonic() - t, 4)}
    return dataclasses.replace(choice, cached=True)
