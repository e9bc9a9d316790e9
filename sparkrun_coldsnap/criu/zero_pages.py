"""Pages of zeros left out of a dump's images.

CRIU dumps every page a process has touched, zeros included: an engine's KV cache that was
allocated but never filled, and on GPUs the host copy of device memory the engine still
held (mostly allocator cache), are gigabytes of zeros. A restore then faults in, clears and
copies each of those pages. Left out of the images, a page of *private anonymous* memory
comes back as zero all the same: CRIU maps such areas fresh (the kernel hands out zeroed
pages), drops the pages of an area a child inherited from its parent that the child's own
images do not list (so a child never sees its parent's data where its own page was zero),
and its lazy-pages daemon maps the zero page for an address the images hold nothing for.
Pages of any other kind of memory keep their place: a private file mapping would show the
file's bytes again, shared memory has images of its own.

The rewrite is of the page maps and pages images only, before the capsule is packed; a dump
this module cannot read is left as it is and says why.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from sparkrun_coldsnap.criu import images as img

_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
WINDOW = 256  # pages compared at once before looking page by page (1 MiB)
_ZERO_WINDOW = bytes(WINDOW * img.PAGE)
_ZERO_PAGE = bytes(img.PAGE)
#: areas whose pages are never left out, whatever CRIU also says of them
_NOT_PLAIN = (
    img.VMA_FILE_PRIVATE | img.VMA_FILE_SHARED | img.VMA_ANON_SHARED | img.VMA_AREA_SYSVIPC | img.VMA_AREA_SOCKET | img.VMA_AREA_VDSO
    | img.VMA_AREA_VVAR | img.VMA_AREA_VSYSCALL | img.VMA_AREA_AIORING | img.VMA_AREA_MEMFD | img.VMA_AREA_SHSTK | img.VMA_AREA_GUARD
    | img.VMA_AREA_UPROBES
)  # fmt: skip


@dataclass
class ZeroPagesReport:
    bytes_before: int = 0
    bytes_after: int = 0
    pages_left_out: int = 0
    processes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pages_bytes_before": self.bytes_before, "pages_bytes_after": self.bytes_after,
            "zero_pages_left_out": self.pages_left_out, "processes": self.processes, "seconds": round(self.seconds, 3),
        }  # fmt: skip
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def plain_vmas(mm_image: Path) -> list[Any]:
    """The private anonymous areas (``VmaEntry``) of the memory map *mm_image*: where a page the
    images do not list comes back as zeros."""
    mm = img.parse("MmEntry", img.ImageFile.read(mm_image, img.MM_MAGIC).entries[0])
    return [v for v in mm.vmas if v.status & img.VMA_ANON_PRIVATE and v.status & img.VMA_AREA_REGULAR and not v.status & _NOT_PLAIN]


class _PlainAreas:
    """The private anonymous areas of one process, for address lookups."""

    def __init__(self, mm_image: Path) -> None:
        areas = sorted((int(v.start), int(v.end)) for v in plain_vmas(mm_image))
        self.starts = [a for a, _ in areas]
        self.ends = [b for _, b in areas]

    def covers(self, start: int, end: int) -> bool:
        """Whether [start, end) lies inside one private anonymous area."""
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and end <= self.ends[i]


def _kept_runs(pages: mmap.mmap, offset: int, vaddr: int, count: int, areas: _PlainAreas) -> list[tuple[int, int]]:
    """Runs (first page, page count) of one present entry that must stay: every page that is
    not zero, or not in a private anonymous area."""
    keep = bytearray(count)  # 1: kept
    for w in range(0, count, WINDOW):
        n = min(WINDOW, count - w)
        a = offset + w * img.PAGE
        window = pages[a : a + n * img.PAGE]
        if window == _ZERO_WINDOW[: n * img.PAGE] and areas.covers(vaddr + w * img.PAGE, vaddr + (w + n) * img.PAGE):
            continue
        for p in range(n):
            q = p * img.PAGE
            page_addr = vaddr + (w + p) * img.PAGE
            if window[q : q + img.PAGE] != _ZERO_PAGE or not areas.covers(page_addr, page_addr + img.PAGE):
                keep[w + p] = 1
    runs, p = [], 0
    while p < count:
        if not keep[p]:
            p += 1
            continue
        start = p
        while p < count and keep[p]:
            p += 1
        runs.append((start, p - start))
    return runs


def _rewrite_process(images: Path, pid: int, report: ZeroPagesReport) -> None:
    pagemap_path = images / ("pagemap-%d.img" % pid)
    areas = _PlainAreas(images / ("mm-%d.img" % pid))
    pagemap = img.ImageFile.read(pagemap_path, img.PAGEMAP_MAGIC)
    head = img.parse("PagemapHead", pagemap.entries[0])
    pages_path = images / ("pages-%d.img" % head.pages_id)
    size = pages_path.stat().st_size
    if size == 0:
        return
    new_entries, copies, out_offset = [pagemap.entries[0]], [], 0
    with open(pages_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as pages:
        for raw, e, offset in img.located_entries(pagemap, size, "%s, %s" % (pagemap_path.name, pages_path.name)):
            if offset is None:
                new_entries.append(raw)  # pages elsewhere (a parent image): nothing here to look at
                continue
            count = img.entry_pages(e)
            runs = _kept_runs(pages, offset, int(e.vaddr), count, areas)
            if runs == [(0, count)]:
                new_entries.append(raw)
            else:
                new_entries += [img.pagemap_entry(int(e.vaddr) + s * img.PAGE, n, int(e.flags)) for s, n in runs]
                report.pages_left_out += count - sum(n for _, n in runs)
            copies += [(offset + s * img.PAGE, n * img.PAGE) for s, n in runs]
            out_offset += sum(n for _, n in runs) * img.PAGE
    report.processes += 1
    if out_offset == size:
        return
    _replace_pages(pages_path, copies)
    tmp = pagemap_path.with_suffix(".img.zero-pages")
    tmp.write_bytes(img.ImageFile(img.PAGEMAP_MAGIC, new_entries).to_bytes())
    os.replace(tmp, pagemap_path)


def _replace_pages(pages_path: Path, copies: list[tuple[int, int]]) -> None:
    """Write the kept byte ranges of *pages_path*, in order, to a new file that replaces it
    (a failure leaves the old file as it was)."""
    tmp = pages_path.with_suffix(".img.zero-pages")
    try:
        copy_ranges(pages_path, tmp, copies)
        os.replace(tmp, pages_path)
    finally:
        tmp.unlink(missing_ok=True)


def copy_ranges(source: Path, target: Path, copies: list[tuple[int, int]]) -> None:
    """Write the byte ranges (start, length) of *source*, in order, to a new file *target*
    (copied inside the kernel, no byte passes through this process)."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        for start, length in merged(copies):
            done = 0
            while done < length:
                n = os.copy_file_range(src.fileno(), dst.fileno(), length - done, start + done)
                if n <= 0:
                    raise OSError("copying %s stopped at byte %d" % (source.name, start + done))
                done += n


def merged(copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges (start, length) with each run of adjoining ones made one."""
    out: list[tuple[int, int]] = []
    for start, length in copies:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def _pages_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


def for_each_process(images: Path, rework: Callable[[int], None], skipped: list[str]) -> None:
    """Call *rework* with the PID of each process whose private memory *images* hold (shared
    memory's page maps, ``pagemap-shmem-*``, are not private memory); a process whose images
    cannot be read is named in *skipped*."""
    for pagemap_path in sorted(images.glob("pagemap-*.img")):
        m = _PAGEMAP.fullmatch(pagemap_path.name)
        if not m:
            continue
        pid = int(m.group(1))
        if not (images / ("mm-%d.img" % pid)).is_file():
            skipped.append("%s: no mm-%d.img beside it" % (pagemap_path.name, pid))
            continue
        try:
            rework(pid)
        except (img.ImageFormatError, DecodeError, IndexError) as err:
            skipped.append(str(err))


def leave_out_zero_pages(images: Path) -> ZeroPagesReport:
    """Rewrite the page maps and pages images in *images* without the zero pages of private
    anonymous memory. Processes whose images cannot be read stay as they are (named in
    ``skipped``); the dump restores either way."""
    t = time.monotonic()
    report = ZeroPagesReport(bytes_before=_pages_bytes(images))
    for_each_process(images, lambda pid: _rewrite_process(images, pid, report), report.skipped)
    report.bytes_after = _pages_bytes(images)
    report.seconds = time.monotonic() - t
    return report
