"""Reading weight files into the page cache during preparation, before the old workload stops.

Hydration after a restore reads the whole model (or the native payload) once more. Read
from disk that is the largest part of a restore (on the H200 machines about 1.6 GB/s, so
8.4 s of a 12.9 s restore of an ~8B model). Preparation already runs while the old
workload still serves, so it reads the files once there, and hydration then copies them
from memory. Only when they fit well within the memory available: page cache is given
back under pressure, and a prefetch that evicts itself buys nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import resident_pages
from sparkrun_coldsnap.host.threads import ContextPool, start_thread
from sparkrun_coldsnap.weights import weight_paths

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.progress import Progress
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

READ = 16 << 20  # bytes per read call
RANGE = 256 << 20  # bytes per task: a large file is read by several threads at once
READERS = 8
#: bytes per read-ahead request (the kernel clamps one to its read-ahead window)
ADVICE = 4 << 20
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


def advise(tasks: Iterable[tuple[int, int, int]]) -> None:
    """Ask the kernel to read each (fd, offset, length) now, without waiting for it: it queues
    them all at the depth the disk takes, where a few reading threads have one read each in
    flight (the files a tree maps are mostly short ranges: 0.61 GB in 374 files read at
    0.39 GB/s that way, on a disk of 1.64 GB/s). Only advice: the reads that follow wait for
    what is still on its way and read whatever the kernel left out."""
    for fd, offset, length in tasks:
        for at in range(offset, offset + length, ADVICE):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, at, min(ADVICE, offset + length - at), os.POSIX_FADV_WILLNEED)


def read_ahead(
    files: Sequence[Path], tick: Callable[[int], None] | None = None, spans: Mapping[Path, Sequence[tuple[int, int]]] | None = None,
    queued: Callable[[], None] | None = None,
) -> int:  # fmt: skip
    """Read every file once (only its *spans*, byte ranges, where given), in ranges spread over
    a few threads (one large file is the usual case: a native payload), so the kernel keeps
    them cached; returns the bytes read. With *spans*, every range is first handed to the
    kernel at once (:func:`advise`), and *queued* is called then: reads issued after that
    line up behind these."""
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
            for start, length in (spans or {}).get(f, ((0, size),)):
                end = min(size, start + length)
                tasks += [(fd, off, min(RANGE, end - off)) for off in range(start, end, RANGE)]
        if spans is not None:
            advise(tasks)
        if queued is not None:
            queued()
        with ContextPool(READERS) as pool:
            return sum(pool.map(one, tasks))
    finally:
        for fd in fds:
            os.close(fd)


def _read_quietly(files: Sequence[Path], spans: Mapping[Path, Sequence[tuple[int, int]]] | None) -> None:
    with contextlib.suppress(OSError):
        read_ahead(files, spans=spans)


def span_bytes(files: Sequence[Path], spans: Mapping[Path, Sequence[tuple[int, int]]]) -> int:
    """How many bytes of *files* reading only their *spans* (where given) reads."""
    total = 0
    for f in files:
        size = f.stat().st_size
        total += sum(max(0, min(size, a + n) - a) for a, n in spans[f]) if f in spans else size
    return total


def _read_into_cache(
    files: Sequence[Path], what: str, key: str, rb: ReceiptBuilder, progress: Progress, *, background: bool = False,
    spans: Mapping[Path, Sequence[tuple[int, int]]] | None = None, queued: Callable[[], None] | None = None,
) -> bool:  # fmt: skip
    """Read *files* into the page cache when they fit; the receipt says what was read, or why not.
    *background*: start reading and return at once (a node with nothing prepared: the restore
    goes ahead meanwhile and finds whatever was read by the time it needs it)."""
    t = time.monotonic()
    try:
        p = plan(files) if spans is None else Plan(tuple(files), span_bytes(files, spans), memory_available())
        if not p.fits:
            rb.details[key] = {"skipped": p.why_not()}
            return False
        if background:
            start_thread(_read_quietly, p.files, spans, name="coldsnap-%s" % key, daemon=True)
            rb.details[key] = {"bytes": p.total, "files": len(files), "background": True}
            return True
        with rb.phase("prepare.%s" % key), progress.transfer("reading %d %s into the page cache" % (len(files), what), p.total) as tick:
            read = read_ahead(files, tick, spans, queued)
    except OSError as err:  # only a head start: the restore reads the files itself and reports what is wrong
        rb.details[key] = {"skipped": "reading %s failed: %s" % (err.filename or "a file", err.strerror)}
        return False
    rb.details[key] = {"bytes": read, "files": len(files), "seconds": round(time.monotonic() - t, 4)}
    return True


def cache_for_restore(
    cfg: CapsuleConfig, choice: WeightChoice, model_dir: str | None, rb: ReceiptBuilder, progress: Progress, *, enabled: bool = True, background: bool = False,
) -> WeightChoice:  # fmt: skip
    """Read the files hydration will read into the page cache now, while the old workload still
    serves; the choice comes back marked ``cached`` when they were read."""
    if not enabled:
        rb.details["weights_cache"] = {"skipped": "COLDSNAP_WEIGHTS_CACHE=off"}
        return choice
    files = weight_paths.files_to_read(cfg, choice, model_dir)
    if not files or not _read_into_cache(files, "weight file(s)", "weights_cache", rb, progress, background=background):
        return choice
    return dataclasses.replace(choice, cached=True)


def cache_capsule_layers(blobs: Sequence[Path], rb: ReceiptBuilder, progress: Progress) -> None:
    """Read the capsule's layer blobs into the page cache at once, by several threads (the
    unpacking then reads them from memory); receipt key ``layers_cache``."""
    files = [b for b in blobs if b.is_file()]
    if files:
        _read_into_cache(files, "capsule layer(s)", "layers_cache", rb, progress)


def cache_tree_files(
    units: Iterable[UnitImage], rb: ReceiptBuilder, progress: Progress, *, enabled: bool = True, background: bool = False,
    programs: Sequence[Path] = (), queued: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Read the files the captured tree mapped or held open (the engine's libraries and code)
    into the page cache. A restored process maps them again as they were and its first request
    runs through their pages: after a cold start of the host those would come from the disk,
    on the clock (about a second for a CUDA engine's libraries). Of a file whose resident
    ranges capture recorded, only those are read (host/resident_pages.py). *programs* (the
    restore's own tools: the driver's ``program_files``) are read whole beside them; *queued*
    is called once every read is handed to the kernel (:func:`read_ahead`)."""
    if not enabled:
        rb.details["files_cache"] = {"skipped": "COLDSNAP_FILES_CACHE=off"}
        return
    recorded = [f for u in units for f in u.files if os.path.isfile(f.path)]
    tools = [p for p in programs if p.is_file()]
    files = sorted({Path(f.path) for f in recorded} | set(tools))
    whole = {Path(f.path) for f in recorded if f.resident is None} | set(tools)
    spans: dict[Path, list[tuple[int, int]]] = {}
    for f in recorded:
        if f.resident is not None and Path(f.path) not in whole:
            spans.setdefault(Path(f.path), []).extend(f.resident)
    spans = {path: resident_pages.join(ranges) for path, ranges in spans.items()}
    if files:
        _read_into_cache(files, "file(s) the workload maps", "files_cache", rb, progress, background=background, spans=spans, queued=queued)
