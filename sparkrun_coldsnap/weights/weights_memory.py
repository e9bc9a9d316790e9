"""A native weight payload copied into memory with huge pages during preparation.

Hydrating from the page cache copies every byte twice on the host (page cache to a bounce
buffer, then to the device) at the host's copy rate: about 10 GB/s on the H200 machines,
1.35 s for an ~8B model. From a file on a memory file system of huge pages, the engine maps
the file, registers the mapping with CUDA, and the GPU's copy engine reads it in place at the
bus's speed (~55 GB/s there); huge pages keep that registration to a few thousand pages.

The copy is made while the old workload still serves (preparation), on a tmpfs of its own
mounted for it (``huge=always``), and unmounted once hydration is over or the restore is
given up. The source is read with direct I/O where the file system allows it, so the page
cache does not hold a second copy; where the payload has a packed copy
(:mod:`sparkrun_coldsnap.weights.packed_payload`), that is read instead and decompressed into
place by several threads: about two thirds of the bytes from the disk.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.errors import IntegrityError, ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.chunked_read import read_chunks
from sparkrun_coldsnap.progress import QUIET
from sparkrun_coldsnap.weights import packed_payload, page_cache, weight_paths

if TYPE_CHECKING:
    from sparkrun_coldsnap.capsule.config import CapsuleConfig
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.progress import Progress
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

READERS = 8
SLACK = 64 << 20  # room beyond the files: tmpfs rounds each file up to whole huge pages


@dataclass
class WeightsInMemory:
    directory: Path
    huge_pages: bool
    bytes: int
    read: int = 0  # bytes read from the disk for it (fewer than ``bytes`` from packed copies)

    def release(self) -> None:
        """Unmount and remove (idempotent; lazily, should the engine still map a file)."""
        if self.directory.is_dir():
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
            try:
                self.directory.rmdir()
            except OSError:
                pass


def root() -> Path:
    return paths.run_dir() / "weights-memory"


def _mount(size: int) -> tuple[Path, bool]:
    root().mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix="payload-", dir=root()))
    errors = []
    for huge in (True, False):  # a kernel without huge pages for tmpfs still gets the copy in memory
        options = "size=%d,mode=0700%s" % (size + SLACK, ",huge=always" if huge else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "coldsnap-weights", str(target)], capture_output=True, text=True)
        if done.returncode == 0:
            return target, huge
        errors.append(done.stderr.strip() or "exit %d" % done.returncode)
    target.rmdir()
    raise ToolError("cannot mount a tmpfs for the weights at %s: %s" % (target, "; ".join(errors)))


def _copy(src: Path, dst: Path) -> int:
    """Copy *src* to *dst* in chunks by several threads; direct reads where allowed."""
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def write(offset: int, view: memoryview) -> None:
        written = 0
        while written < len(view):
            written += os.pwrite(fd_out, view[written:], offset + written)

    try:
        return read_chunks(src, write, threads=READERS)[0]
    finally:
        os.close(fd_out)


def _unpack(packed: Path, index: packed_payload.Index, dst: Path, tick: Callable[[int], None] | None) -> int:
    fd_out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return packed_payload.unpack_into(packed, index, fd_out, tick=tick)
    finally:
        os.close(fd_out)


def copy_into_memory(files: list[Path], *, packed: dict[Path, packed_payload.Index] | None = None, tick: Callable[[int], None] | None = None) -> WeightsInMemory:
    """Copy *files* (one directory's) into a fresh huge-page tmpfs, each from its packed copy
    where *packed* names one; nothing is left mounted on failure."""
    packed = packed or {}
    total = sum(f.stat().st_size for f in files)
    target, huge = _mount(total)
    staged = WeightsInMemory(target, huge, total, read=0)
    try:
        for f in files:
            index = packed.get(f)
            if index is not None:
                _unpack(packed_payload.packed_path(f), index, target / f.name, tick)
                staged.read += index.packed_bytes
            else:
                staged.read += _copy(f, target / f.name)
                if tick:
                    tick(f.stat().st_size)
    except BaseException:
        staged.release()
        raise
    return staged


def packed_copies(cfg: CapsuleConfig, choice: WeightChoice) -> dict[Path, packed_payload.Index]:
    """The payload's files that have a usable packed copy on this host, with its index."""
    if cfg.weights.native is None or choice.native_dir is None:
        return {}
    out = {}
    for f in cfg.weights.native.files:
        path = choice.native_dir / f.name
        index = packed_payload.usable(path, f.size, f.sha256)
        if index is not None:
            out[path] = index
    return out


def stage_for_restore(cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder, progress: Progress) -> WeightChoice:
    """Copy the native payload *choice* reads into memory; the choice comes back with
    ``in_memory`` set, or as it was with the reason in ``details.weights_memory``."""
    if choice.path != "native" or choice.native_dir is None:
        return choice
    files = weight_paths.files_to_read(cfg, choice, None)
    p = page_cache.plan(files)
    if not p.fits:
        rb.details["weights_memory"] = {"skipped": p.why_not()}
        return choice
    packed = packed_copies(cfg, choice) if settings_mod.current().packed_payload else {}
    t = time.monotonic()
    how = "from its packed copy " if packed else ""
    try:
        with rb.phase("prepare.weights_memory"), progress.transfer("copying the native weight payload (%.1f GB) %sinto memory" % (p.total / 1e9, how), p.total) as tick:
            staged = copy_into_memory(list(files), packed=packed, tick=tick)
    except (OSError, ToolError, IntegrityError) as err:  # only a faster path: hydration reads the payload where it is
        rb.details["weights_memory"] = {"skipped": str(err)}
        return choice
    rb.details["weights_memory"] = {
        "bytes": staged.bytes, "read": staged.read, "packed": bool(packed), "huge_pages": staged.huge_pages, "seconds": round(time.monotonic() - t, 4),
    }  # fmt: skip
    return dataclasses.replace(choice, in_memory=staged)


class StagingJob:
    """:func:`stage_for_restore` on a thread of its own: the payload is read while preparation
    unpacks the capsule and reads the tree's files (the disk is shared, the waiting is not)."""

    def __init__(self, cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder) -> None:
        pool = ThreadPoolExecutor(1, thread_name_prefix="coldsnap-weights-memory")
        self._future: Future[WeightChoice] = pool.submit(stage_for_restore, cfg, choice, rb, QUIET)
        pool.shutdown(wait=False)

    def result(self) -> WeightChoice:
        return self._future.result()

    def discard(self) -> None:
        """Wait for the copy and let it go (a preparation given up, or its restore done)."""
        try:
            self._future.result().release_memory()
        except BaseException:  # noqa: BLE001 - what failed was already reported by whoever waited for it
            pass


def start_staging(cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder, progress: Progress) -> StagingJob | None:
    """Start copying the native payload *choice* reads into memory, alongside the rest of preparation."""
    if choice.path != "native" or choice.native_dir is None:
        return None
    progress.step("copying the native weight payload into memory alongside")
    return StagingJob(cfg, choice, rb)
