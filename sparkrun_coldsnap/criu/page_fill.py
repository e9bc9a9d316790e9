"""A restored tree's memory written from several threads, instead of by CRIU alone.

CRIU fills a process's pages with one thread per process, bound by page faults (about 1 GB/s
for the engine's biggest process), while the host writes fresh memory several times faster
from several threads. So, while a restore is being prepared, the bulk of each process's
private anonymous memory is taken out of CRIU's images (``split_for_fill``): CRIU brings
those areas back as zeros (see :mod:`sparkrun_coldsnap.criu.zero_pages` for why that is
sound, a child's inherited areas included) and leaves the tree stopped; ``fill`` then
writes the pages into the stopped processes with ``process_vm_writev`` from a pool of
threads, over every process's pages at once, before the tree is continued. Staged on a
tmpfs, the data file's pages are given back as they are written (a virtual machine that
returns freed memory to its hypervisor otherwise faults every fresh page in through it).

The split moves no page: the original pages image becomes the fill's data file (a second
link to it), and small new pages and page map images keep only what CRIU still restores.
Each process's fill index, written last, says that its split is complete; a split that
fails leaves the images as they were.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.criu import images as img
from sparkrun_coldsnap.criu.zero_pages import copy_ranges, for_each_process, plain_vmas
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host.process_tree import inner_pid, threads_stopped, tree_pids
from sparkrun_coldsnap.host.threads import ContextPool

#: areas smaller than this stay with CRIU: a fill pays off on the big ones
MIN_AREA_BYTES = 1 << 20
#: bytes one thread writes in one go: small enough that the biggest process spreads over
#: every thread and that little staged memory is held before it is given back (below), big
#: enough that the calls cost nothing beside the page faults
CHUNK_BYTES = 8 << 20
_IOV_MAX = 1024  # iovecs one process_vm_writev takes
_MAP_HUGETLB = 0x40000
_TMPFS_MAGIC = 0x01021994
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
#: written in the images' folder once a fill has given their pages back: they restore no more
SPENT = "fill-spent"


def index_path(images: Path, pid: int) -> Path:
    return images / ("fill-%d.json" % pid)


def indexes(images: Path) -> list[Path]:
    """The fill indexes of *images*: one for each process whose split is complete."""
    return sorted(images.glob("fill-*.json"))


@dataclass
class FillSplit:
    bytes_moved: int = 0
    bytes_kept: int = 0
    processes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes_moved": self.bytes_moved, "bytes_kept": self.bytes_kept, "processes": self.processes, "seconds": round(self.seconds, 3)}
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def _fill_areas(mm_image: Path, min_area_bytes: int) -> tuple[list[int], list[int]]:
    """Starts and ends of the areas whose pages the fill writes: private anonymous, writable
    (``process_vm_writev`` writes only where the process may), not a stack, not huge pages."""
    areas = sorted(
        (int(v.start), int(v.end)) for v in plain_vmas(mm_image)
        if v.prot & mmap.PROT_WRITE and not v.status & img.VMA_AREA_STACK and not v.flags & _MAP_HUGETLB and v.end - v.start >= min_area_bytes
    )  # fmt: skip
    return [a for a, _ in areas], [b for _, b in areas]


def _pieces(vaddr: int, length: int, starts: list[int], ends: list[int]) -> list[tuple[int, int, bool]]:
    """[vaddr, vaddr + length) cut at the fill areas' edges: (start, length, inside an area)."""
    out, pos, end = [], vaddr, vaddr + length
    while pos < end:
        i = bisect.bisect_right(starts, pos) - 1
        if i >= 0 and pos < ends[i]:
            stop, inside = min(end, ends[i]), True
        else:
            stop, inside = min(end, starts[i + 1] if i + 1 < len(starts) else end), False
        out.append((pos, stop - pos, inside))
        pos = stop
    return out


def _join(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(vaddr, length, offset) runs with each one that continues the one before, in memory and
    in the data file, made one."""
    out: list[tuple[int, int, int]] = []
    for vaddr, length, offset in runs:
        if out and out[-1][0] + out[-1][1] == vaddr and out[-1][2] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length, out[-1][2])
        else:
            out.append((vaddr, length, offset))
    return out


def _split_process(images: Path, pid: int, min_area_bytes: int, report: FillSplit) -> None:
    pagemap_path = images / ("pagemap-%d.img" % pid)
    if index_path(images, pid).is_file():
        report.bytes_moved += json.loads(index_path(images, pid).read_text())["bytes"]
        report.processes += 1
        return  # split by an earlier preparation of the same images
    starts, ends = _fill_areas(images / ("mm-%d.img" % pid), min_area_bytes)
    pagemap = img.ImageFile.read(pagemap_path, img.PAGEMAP_MAGIC)
    pages_path = images / ("pages-%d.img" % img.parse("PagemapHead", pagemap.entries[0]).pages_id)
    size = pages_path.stat().st_size
    kept_entries, copies, runs = [pagemap.entries[0]], [], []
    for raw, e, offset in img.located_entries(pagemap, size, "%s, %s" % (pagemap_path.name, pages_path.name)):
        if offset is None:
            kept_entries.append(raw)  # pages in a parent image: CRIU's to restore
            continue
        pieces = _pieces(int(e.vaddr), img.entry_pages(e) * img.PAGE, starts, ends)
        if not any(inside for _, _, inside in pieces):
            kept_entries.append(raw)
            copies.append((offset, img.entry_pages(e) * img.PAGE))
            continue
        for start, length, inside in pieces:
            at = offset + start - int(e.vaddr)
            if inside:
                runs.append((start, length, at))
            else:
                kept_entries.append(img.pagemap_entry(start, length // img.PAGE, int(e.flags)))
                copies.append((at, length))
    moved = sum(length for _, length, _ in runs)
    report.processes += 1
    report.bytes_kept += size - moved
    if moved:
        _commit(images, pid, pagemap_path, pages_path, kept_entries, copies, _join(runs))
        report.bytes_moved += moved


def _commit(images: Path, pid: int, pagemap_path: Path, pages_path: Path, kept_entries: list[bytes], copies: list[tuple[int, int]], runs: list[tuple[int, int, int]]) -> None:
    """Put one process's split in place: every new file written aside first, then renamed over
    the old ones, the index last; a failure on the way renames the old ones back."""
    data, index = images / ("fill-%d.pages" % pid), index_path(images, pid)
    old_pagemap = pagemap_path.with_suffix(".img.before-fill")
    new_pages, new_pagemap, new_index = pages_path.with_suffix(".img.fill"), pagemap_path.with_suffix(".img.fill"), index.with_suffix(".json.tmp")
    replaced = False
    try:
        for leftover in (data, old_pagemap):
            leftover.unlink(missing_ok=True)  # of a split that was killed half-way
        os.link(pages_path, data)  # the original pages stay where the fill reads them
        os.link(pagemap_path, old_pagemap)
        copy_ranges(pages_path, new_pages, copies)
        new_pagemap.write_bytes(img.ImageFile(img.PAGEMAP_MAGIC, kept_entries).to_bytes())
        new_index.write_text(json.dumps({"pid": pid, "data": data.name, "bytes": sum(r[1] for r in runs), "runs": runs}))
        replaced = True
        os.replace(new_pages, pages_path)
        os.replace(new_pagemap, pagemap_path)
        os.replace(new_index, index)
    except BaseException:
        if replaced:
            os.replace(data, pages_path)
            os.replace(old_pagemap, pagemap_path)
        for path in (data, old_pagemap, new_pages, new_pagemap, new_index, index):
            path.unlink(missing_ok=True)
        raise
    old_pagemap.unlink()


def split_for_fill(images: Path, *, min_area_bytes: int = MIN_AREA_BYTES) -> FillSplit:
    """Take the pages of each process's big writable private anonymous areas out of CRIU's
    images in *images*, for ``fill`` to write after the restore. A process whose images cannot
    be read, or whose split fails, stays as it was (named in ``skipped``)."""
    t = time.monotonic()
    report = FillSplit()

    def split(pid: int) -> None:
        try:
            _split_process(images, pid, min_area_bytes, report)
        except OSError as err:  # e.g. no room for the new images: this process stays as dumped
            report.skipped.append("pagemap-%d.img: %s" % (pid, err))

    for_each_process(images, split, report.skipped)
    report.seconds = time.monotonic() - t
    return report


# -- the fill, after CRIU has restored the tree and left it stopped ---------------------------


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL: the threads write at once
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_long * 15)]


_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class FillReport:
    bytes: int = 0
    processes: int = 0
    threads: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        rate = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        return {"bytes": self.bytes, "processes": self.processes, "threads": self.threads, "seconds": round(self.seconds, 4), "gb_per_s": round(rate, 2)}


def fill_planned(images: Path) -> bool:
    """Whether *images* were split for a fill; refused once a fill gave their pages back, since
    CRIU would then restore those areas as zeros with nothing to write them."""
    if spent(images):
        raise RestoreError("the staged images in %s were already used by a memory fill, which gave their pages back: stage them again" % images)
    return bool(indexes(images))


def planned_bytes(images: Path) -> int:
    """What ``fill`` will write for *images*."""
    return sum(int(json.loads(p.read_text())["bytes"]) for p in indexes(images))


def image_pids(root_pid: int) -> dict[int, int]:
    """The restored tree's processes by the PIDs the images give them (the PID inside the
    tree's own PID namespace, the host's when it has none)."""
    out = {}
    for pid in tree_pids(root_pid):
        try:
            out[inner_pid(pid)] = pid
        except (OSError, StopIteration):
            continue  # gone meanwhile
    return out


def await_stopped(pids: list[int], *, timeout: float = 5.0) -> None:
    """Wait until every thread of *pids* shows stopped. ``criu restore --leave-stopped`` queues
    the stop and lets go of each task at once: the task takes the stop on its way back to its
    own code, and may not show stopped yet when ``criu`` returns."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while not threads_stopped(pid):
            if time.monotonic() > deadline:
                raise RestoreError("restored pid %d did not stop within %.0f s of criu restore --leave-stopped" % (pid, timeout))
            time.sleep(0.001)


def _write(pid: int, base: int, runs: list[tuple[int, int, int]]) -> int:
    """Write *runs* (vaddr, length, offset from *base*) into *pid*, resuming after a short write."""
    todo = [(vaddr, length, offset) for vaddr, length, offset in runs]
    while todo:
        batch = todo[:_IOV_MAX]
        local = (_Iovec * len(batch))(*[_Iovec(base + offset, length) for _, length, offset in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(vaddr, length) for vaddr, length, _ in batch])
        n = _libc.process_vm_writev(pid, local, len(batch), remote, len(batch), 0)
        if n <= 0:
            errno = ctypes.get_errno() if n < 0 else 0
            raise RestoreError("writing the memory of restored pid %d at %#x failed: %s" % (pid, batch[0][0], os.strerror(errno) if errno else "nothing was written"))
        while n:  # drop what was written, cut into the run it stopped in
            vaddr, length, offset = todo[0]
            if n >= length:
                todo.pop(0)
                n -= length
            else:
                todo[0] = (vaddr + n, length - n, offset + n)
                n = 0
    return sum(length for _, length, _ in runs)


def _chunks(runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """*runs* cut into pieces of about CHUNK_BYTES each."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = CHUNK_BYTES
    for vaddr, length, offset in runs:
        while length:
            n = min(length, room)
            out[-1].append((vaddr, n, offset))
            vaddr, length, offset, room = vaddr + n, length - n, offset + n, room - n
            if not room:
                out.append([])
                room = CHUNK_BYTES
    return [c for c in out if c]


def _mapped(path: Path) -> tuple[int, int]:
    """*path* mapped read-only: its address and size (0, 0 when empty)."""
    size = path.stat().st_size
    if not size:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, _MAP_FAILED):
        raise RestoreError("mapping %s for the memory fill failed: %s" % (path.name, os.strerror(ctypes.get_errno())))
    return addr, size


def spent(images: Path) -> bool:
    """Whether a fill gave the pages of *images* back: what is left would restore zeros."""
    return (images / SPENT).exists()


def on_tmpfs(path: Path) -> bool:
    """Whether *path* is on a tmpfs (statfs's file system type)."""
    st = _Statfs()
    return _libc.statfs(os.fsencode(path), ctypes.byref(st)) == 0 and st.f_type == _TMPFS_MAGIC


def _give_back_as_written(images: Path, data: Path) -> int | None:
    """A descriptor to punch *data*'s pages out as they are written, or None to keep them.

    Staged on a tmpfs, the data file holds as much memory as the tree is about to take. Freed
    chunk by chunk as it is written, that memory is what the tree's next page faults pick up,
    still held by the host: a virtual machine that hands freed memory back to its hypervisor
    (free page reporting) otherwise faults each fresh page in through the hypervisor, several
    times slower. Only a file with no other link (a hard-linked copy of a pristine dump stays
    whole) and only once *images* are marked spent (they restore nothing after this)."""
    if not on_tmpfs(data) or data.stat().st_nlink != 1:
        return None
    (images / SPENT).write_text("the memory fill gave these pages back: stage the images again\n")
    return os.open(data, os.O_RDWR | os.O_CLOEXEC)


def _write_and_give_back(pid: int, base: int, runs: list[tuple[int, int, int]], fd: int | None) -> int:
    written = _write(pid, base, runs)
    if fd is not None:
        for _, length, offset in runs:
            _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, offset, length)  # a hole not punched only costs memory
    return written


def fill(images: Path, root_pid: int, *, threads: int) -> FillReport:
    """Write the pages ``split_for_fill`` took out of *images* into the restored (stopped) tree
    at *root_pid*, from *threads* threads over every process's pages at once."""
    t = time.monotonic()
    fill_planned(images)
    plans = [json.loads(p.read_text()) for p in indexes(images)]
    restored = image_pids(root_pid)
    missing = [plan["pid"] for plan in plans if plan["pid"] not in restored]
    if missing:
        raise RestoreError("process %d of the images is not in the tree restored at pid %d" % (missing[0], root_pid))
    await_stopped([restored[plan["pid"]] for plan in plans])
    maps: list[tuple[int, int]] = []
    fds: list[int] = []
    work: list[tuple[int, int, list[tuple[int, int, int]], int | None]] = []
    try:
        for plan in plans:
            base, size = _mapped(images / plan["data"])
            maps.append((base, size))
            runs = [(int(v), int(n), int(o)) for v, n, o in plan["runs"]]
            if any(o + n > size for _, n, o in runs):
                raise RestoreError("%s is shorter than its fill index says: the staged images are damaged, stage them again" % plan["data"])
            fd = _give_back_as_written(images, images / plan["data"])
            if fd is not None:
                fds.append(fd)
            work += [(restored[plan["pid"]], base, chunk, fd) for chunk in _chunks(runs)]
        count = max(1, min(threads, len(work)))
        with ContextPool(max_workers=count, thread_name_prefix="page-fill") as pool:
            futures = [pool.submit(_write_and_give_back, pid, base, chunk, fd) for pid, base, chunk, fd in work]
            try:
                written = sum(f.result() for f in futures)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        for base, size in maps:
            if size:
                _libc.munmap(base, size)
        for fd in fds:
            os.close(fd)
    return FillReport(bytes=written, processes=len(plans), threads=count, seconds=time.monotonic() - t)
