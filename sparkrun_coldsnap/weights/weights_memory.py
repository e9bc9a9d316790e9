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

On a node with nothing prepared the restore goes ahead while the copy is under way
(``COLDSNAP_CACHE_IN_BACKGROUND=1``): every file is created at its full size first, and a
mark per file (:mod:`sparkrun_coldsnap.weights.fill_marks`) says how far it is filled, so the
engine hydrates behind the copy instead of after it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.errors import IntegrityError, ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.background import in_background
from sparkrun_coldsnap.host.chunked_read import read_chunks
from sparkrun_coldsnap.progress import QUIET
from sparkrun_coldsnap.weights import container_mounts, packed_payload, page_cache, weight_paths
from sparkrun_coldsnap.weights.fill_marks import FillMark

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig
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
    shared: bool = False  # a directory in the containers' shared tmpfs, not a tmpfs of its own

    def release(self) -> None:
        """Unmount and remove (idempotent; lazily, should the engine still map a file)."""
        if self.shared:
            # The engine's mappings keep their pages until it lets them go; the names go now.
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        if self.directory.is_dir():
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
            try:
                self.directory.rmdir()
            except OSError:
                pass


def root() -> Path:
    return paths.run_dir() / "weights-memory"


def _mount_tmpfs(target: Path, size: int) -> bool:
    """A tmpfs of *size* bytes at *target*, with huge pages where the kernel has them; whether it has."""
    errors = []
    for huge in (True, False):  # a kernel without huge pages for tmpfs still gets the copy in memory
        options = "size=%d,mode=0700%s" % (size, ",huge=always" if huge else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "coldsnap-weights", str(target)], capture_output=True, text=True)
        if done.returncode == 0:
            return huge
        errors.append(done.stderr.strip() or "exit %d" % done.returncode)
    raise ToolError("cannot mount a tmpfs for the weights at %s: %s" % (target, "; ".join(errors)))


def _mount(size: int) -> tuple[Path, bool]:
    root().mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix="payload-", dir=root()))
    try:
        return target, _mount_tmpfs(target, size + SLACK)
    except ToolError:
        target.rmdir()
        raise


def mount_shared_root() -> bool:
    """Mount the shared tmpfs if it is not (idempotent); whether it has huge pages. Its size is
    only a limit: it holds what the restores under way copied, and grows with them."""
    target = container_mounts.shared_root()
    target.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(target):
        return _mount_tmpfs(target, SLACK)
    return "huge=always" in _options_of(target)


def _options_of(target: Path) -> str:
    """The mount options of the file system mounted last at *target*."""
    found = [f[3] for f in (line.split() for line in Path("/proc/self/mounts").read_text().splitlines()) if len(f) > 3 and f[1] == str(target)]
    return found[-1] if found else ""


def _in_shared_root(size: int) -> tuple[Path, bool]:
    """A directory for a copy of *size* bytes in the shared tmpfs, grown to hold it beside what it holds."""
    huge = mount_shared_root()
    target = container_mounts.shared_root()
    st = os.statvfs(target)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    want = used + size + SLACK
    if st.f_blocks * st.f_frsize < want:
        done = subprocess.run(["mount", "-o", "remount,size=%d" % want, str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolError("cannot grow the weights' tmpfs at %s to %.2f GB: %s" % (target, want / 1e9, done.stderr.strip() or "exit %d" % done.returncode))
    return Path(tempfile.mkdtemp(prefix="payload-", dir=target)), huge


def _copy(src: Path, dst: Path, mark: FillMark) -> int:
    """Copy *src* to *dst* (created at its size) in chunks by several threads; direct reads where allowed."""
    fd_out = os.open(dst, os.O_WRONLY, 0o600)

    def write(offset: int, view: memoryview) -> None:
        written = 0
        while written < len(view):
            written += os.pwrite(fd_out, view[written:], offset + written)
        mark.done(offset, len(view))

    try:
        return read_chunks(src, write, threads=READERS)[0]
    finally:
        os.close(fd_out)


def _unpack(packed: Path, index: packed_payload.Index, dst: Path, mark: FillMark, tick: Callable[[int], None] | None) -> int:
    fd_out = os.open(dst, os.O_RDWR, 0o600)

    def placed(n: int) -> None:  # pieces are decompressed in order
        mark.done(mark.filled, n)
        if tick:
            tick(n)

    try:
        return packed_payload.unpack_into(packed, index, fd_out, threads=packed_payload.restore_threads(), tick=placed)
    finally:
        os.close(fd_out)


def copy_into_memory(
    files: list[Path], *, packed: dict[Path, packed_payload.Index] | None = None, tick: Callable[[int], None] | None = None,
    on_ready: Callable[[WeightsInMemory], None] | None = None, shared: bool = False,
) -> WeightsInMemory:  # fmt: skip
    """Copy *files* (one directory's) into a fresh huge-page tmpfs (with *shared*, a directory
    of the containers' shared one), each from its packed copy where *packed* names one; nothing
    is left on failure. *on_ready* is handed the copy as soon as every file exists at its full
    size, before any is filled: a reader may follow the copy by its marks (the small files, an
    engine's index, are filled first)."""
    packed = packed or {}
    sizes = {f: f.stat().st_size for f in files}
    total = sum(sizes.values())
    target, huge = _in_shared_root(total) if shared else _mount(total)
    staged = WeightsInMemory(target, huge, total, read=0, shared=shared)
    marks: dict[Path, FillMark] = {}
    try:
        for f, size in sizes.items():
            with open(target / f.name, "xb") as out:
                out.truncate(size)
            marks[f] = FillMark(target, f.name)
        if on_ready is not None:
            on_ready(staged)
        for f in sorted(files, key=sizes.__getitem__):
            index = packed.get(f)
            if index is not None:
                _unpack(packed_payload.packed_path(f), index, target / f.name, marks[f], tick)
                staged.read += index.packed_bytes
            else:
                staged.read += _copy(f, target / f.name, marks[f])
                if tick:
                    tick(sizes[f])
    except BaseException:
        for mark in marks.values():
            mark.give_up()
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


def stage_for_restore(
    cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder, progress: Progress, *, on_ready: Callable[[WeightsInMemory], None] | None = None,
    from_packed: bool | None = None, shared: bool = False,
) -> WeightChoice:  # fmt: skip
    """Copy the native payload *choice* reads into memory; the choice comes back with
    ``in_memory`` set, or as it was with the reason in ``details.weights_memory``.
    *on_ready*, *shared*: as :func:`copy_into_memory`'s; *from_packed*: read packed copies
    where there are (default: ``COLDSNAP_PACKED_PAYLOAD``)."""
    if choice.path != "native" or choice.native_dir is None:
        return choice
    files = weight_paths.files_to_read(cfg, choice, None)
    p = page_cache.plan(files)
    if not p.fits:
        rb.details["weights_memory"] = {"skipped": p.why_not()}
        return choice
    packed = packed_copies(cfg, choice) if (settings_mod.current().packed_payload if from_packed is None else from_packed) else {}
    t = time.monotonic()
    how = "from its packed copy " if packed else ""
    try:
        with rb.phase("prepare.weights_memory"), progress.transfer("copying the native weight payload (%.1f GB) %sinto memory" % (p.total / 1e9, how), p.total) as tick:
            staged = copy_into_memory(list(files), packed=packed, tick=tick, on_ready=on_ready, shared=shared)
    except (OSError, ToolError, IntegrityError) as err:  # only a faster path: hydration reads the payload where it is
        rb.details["weights_memory"] = {"skipped": str(err)}
        return choice
    rb.details["weights_memory"] = {
        "bytes": staged.bytes, "read": staged.read, "packed": bool(packed), "huge_pages": staged.huge_pages, "seconds": round(time.monotonic() - t, 4),
    }  # fmt: skip
    return dataclasses.replace(choice, in_memory=staged)


class StagingJob:
    """:func:`stage_for_restore` on a thread of its own: the payload is read while preparation
    unpacks the capsule and the restore runs (the disk is shared, the waiting is not)."""

    def __init__(self, cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder, *, after: Future[None] | None = None, shared: bool = False) -> None:
        self._created = threading.Event()
        self._early: WeightsInMemory | None = None
        from_packed = settings_mod.current().packed_payload  # the settings of the restore that starts it, whenever it runs

        def stage() -> WeightChoice:
            if after is not None:
                after.exception()  # what it raised is its own caller's to report
            return stage_for_restore(cfg, choice, rb, QUIET, on_ready=self._ready, from_packed=from_packed, shared=shared)

        self._future: Future[WeightChoice] = in_background(stage)
        self._future.add_done_callback(lambda _: self._created.set())

    def _ready(self, staged: WeightsInMemory) -> None:
        self._early = staged
        self._created.set()

    def early(self) -> WeightsInMemory | None:
        """The copy as soon as its files exist, still being filled (a reader follows it by its
        marks); None when the copy ended before that (skipped, or failed)."""
        self._created.wait()
        return self._early

    def result(self) -> WeightChoice:
        return self._future.result()

    def discard(self) -> None:
        """Wait for the copy and let it go (a preparation given up, or its restore done)."""
        try:
            self._future.result().release_memory()
        except BaseException:  # noqa: BLE001 - what failed was already reported by whoever waited for it
            pass


def start_staging(
    cfg: CapsuleConfig, choice: WeightChoice, rb: ReceiptBuilder, progress: Progress, *, after: Future[None] | None = None, shared: bool = False,
) -> StagingJob | None:  # fmt: skip
    """Start copying the native payload *choice* reads into memory, alongside the rest of
    preparation; once *after* is done, where given (what must reach the disk first); *shared*:
    into the containers' shared tmpfs."""
    if choice.path != "native" or choice.native_dir is None:
        return None
    progress.step("copying the native weight payload into memory alongside")
    return StagingJob(cfg, choice, rb, after=after, shared=shared)
