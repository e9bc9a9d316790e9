"""A native weight payload copied into memory with huge pages during preparation.

Hydrating from the page cache copies every byte twice on the host (page cache to a bounce
buffer, then to the device) at the host's copy rate: about 10 GB/s on the H200 machines,
1.35 s for an ~8B model. From a file on a memory file system of huge pages, the engine maps
the file, registers the mapping with CUDA, and the GPU's copy engine reads it in place at the
bus's speed (~55 GB/s there); huge pages keep that registration to a few thousand pages.

The copy is made while the old workload still serves (preparation), on a tmpfs of its own
mounted for it (``huge=always``), and unmounted once hydration is over or the restore is
given up. The source is read with direct I/O where the file system allows it, so the page
cache does not hold a second copy.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.chunked_read import read_chunks
from sparkrun_coldsnap.weights import page_cache, weight_paths

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


def copy_into_memory(files: list[Path]) -> WeightsInMemory:
    """Copy *files* (one directory's) into a fresh huge-page tmpfs; nothing is left mounted on failure."""
    total = sum(f.stat().st_size for f in files)
    target, huge = _mount(total)
    staged = WeightsInMemory(target, huge, total)
    try:
        for f in files:
            _copy(f, target / f.name)
    except BaseException:
        staged.release()
        raise
    return staged


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
    t = time.monotonic()
    try:
        with rb.phase("prepare.weights_memory"), progress.waiting("copying the native weight payload (%.1f GB) into memory" % (p.total / 1e9)):
            staged = copy_into_memory(list(files))
    except (OSError, ToolError) as err:  # only a faster path: hydration reads the payload where it is
        rb.details["weights_memory"] = {"skipped": str(err)}
        return choice
    rb.details["weights_memory"] = {"bytes": staged.bytes, "huge_pages": staged.huge_pages, "seconds": round(time.monotonic() - t, 4)}
    return dataclasses.replace(choice, in_memory=staged)
