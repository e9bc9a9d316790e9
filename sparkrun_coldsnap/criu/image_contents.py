"""What a dump's process images hold, area by area: where a restore's bytes come from.

`criu restore` writes every page the images list into fresh memory, so its time follows
their bytes. Knowing which areas hold them (the heap, anonymous areas such as allocator
arenas and the host copy of device memory, private file pages a process wrote to) says what
is worth making smaller. Read from the page maps and the memory maps only: no page is read.
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from sparkrun_coldsnap.criu import images as img

_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
LARGEST = 5

#: the first flag an area has names its kind (a heap is also anonymous and private)
_KINDS = (
    (img.VMA_AREA_HEAP, "heap"), (img.VMA_AREA_STACK, "stack"), (img.VMA_FILE_PRIVATE, "file, private"),
    (img.VMA_FILE_SHARED, "file, shared"), (img.VMA_ANON_SHARED, "shared"), (img.VMA_ANON_PRIVATE, "anonymous"),
)  # fmt: skip


def area_kind(status: int) -> str:
    return next((name for flag, name in _KINDS if status & flag), "other")


def _prot(prot: int) -> str:
    return "".join(c if prot & bit else "-" for c, bit in (("r", 1), ("w", 2), ("x", 4)))


def _process(images: Path, pid: int, largest: int) -> dict[str, Any]:
    mm = img.parse("MmEntry", img.ImageFile.read(images / ("mm-%d.img" % pid), img.MM_MAGIC).entries[0])
    vmas = sorted(mm.vmas, key=lambda v: int(v.start))
    starts = [int(v.start) for v in vmas]
    held = [0] * len(vmas)
    outside = 0
    pagemap = img.ImageFile.read(images / ("pagemap-%d.img" % pid), img.PAGEMAP_MAGIC)
    for raw in pagemap.entries[1:]:
        e = img.parse("PagemapEntry", raw)
        if not e.flags & img.PE_PRESENT:
            continue  # in a parent image: not read by this restore
        # An entry may run on across neighbouring areas: each gets its part.
        start = int(e.vaddr)
        end = start + img.entry_pages(e) * img.PAGE
        counted = 0
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(vmas) and int(vmas[i].start) < end:
            part = min(end, int(vmas[i].end)) - max(start, int(vmas[i].start))
            if part > 0:
                held[i] += part
                counted += part
            i += 1
        outside += end - start - counted
    by_kind: dict[str, int] = {}
    for v, n in zip(vmas, held):
        if n:
            kind = area_kind(int(v.status))
            by_kind[kind] = by_kind.get(kind, 0) + n
    top = sorted((i for i, n in enumerate(held) if n), key=lambda i: -held[i])[:largest]
    out: dict[str, Any] = {
        "pid": pid, "bytes": sum(held) + outside, "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "largest": [
            {"start": hex(int(vmas[i].start)), "size": int(vmas[i].end) - int(vmas[i].start), "bytes": held[i], "kind": area_kind(int(vmas[i].status)), "prot": _prot(int(vmas[i].prot))}
            for i in top
        ],
    }  # fmt: skip
    if outside:
        out["outside_areas"] = outside
    return out


def held_by_area(images: Path, *, largest: int = LARGEST) -> dict[str, Any]:
    """Per process of the dump in *images*, largest first: the bytes its images hold, by kind of
    area, and its *largest* areas by bytes held. A process whose images cannot be read is named
    in ``skipped``."""
    processes, skipped = [], []
    for path in sorted(images.glob("pagemap-*.img")):
        m = _PAGEMAP.fullmatch(path.name)
        if not m:
            continue  # shared memory's page maps: counted with the memory they belong to, not a process
        try:
            processes.append(_process(images, int(m.group(1)), largest))
        except (img.ImageFormatError, DecodeError, IndexError, OSError) as err:
            skipped.append("%s: %s" % (path.name, err))
    out: dict[str, Any] = {"processes": sorted(processes, key=lambda p: -p["bytes"])}
    if skipped:
        out["skipped"] = skipped
    return out
