"""Which parts of its mapped files a process tree has in memory: what a restored tree reads first.

A restored process maps its libraries again as they were, and its first request runs through
the pages it used before; on a node whose page cache is empty those come from the disk. A CUDA
engine maps about 4.7 GB of libraries, of which it touches a part (kernels for other GPUs,
code for other paths). So capture records, for each mapped file, the byte ranges whose pages
the tree had mapped in (``/proc/PID/pagemap``), and preparation reads only those.

A page the tree wrote to in a private mapping of a file (a library's data, its relocated
tables) is a private copy: CRIU dumps its contents, but restoring them writes into a fresh
private mapping of the file, and the kernel first reads the file's page to copy it. So those
pages count too: on an 8B vLLM beside the weights' copy, the restored engine waited 1.8 s
for such reads of its libraries inside ``criu restore``.

Nearby ranges are joined (a read of a small gap costs less than another request), and a file
with very many ranges is joined more coarsely, so the record stays small.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
PRESENT = np.uint64(1 << 63)
SWAPPED = np.uint64(1 << 62)
#: gaps up to this many bytes between two ranges are read with them
JOIN_GAP = 256 << 10
#: at most this many ranges per file: beyond it the gap to join grows
MOST_RANGES = 256


def _file_mappings(pid: int) -> list[tuple[str, int, int, int]]:
    """(path, start, end, file offset) of each mapping of a regular file by *pid*."""
    out = []
    try:
        with open("/proc/%d/maps" % pid) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((parts[5].rstrip("\n"), start, end, int(parts[2], 16)))
    except OSError:
        pass
    return out


def _present_pages(pagemap: int, start: int, end: int) -> np.ndarray:
    """Indexes (from *start*, in pages) of the pages of [start, end) in memory: mapped in from
    their file, or private copies of it (in memory or swapped out), whose restore reads it."""
    n = (end - start) // PAGE
    raw = os.pread(pagemap, n * 8, start // PAGE * 8)
    entries = np.frombuffer(raw, dtype=np.uint64)
    return np.flatnonzero((entries & (PRESENT | SWAPPED)).astype(bool))


def _runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """Ascending page numbers -> (first, count) runs."""
    if pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [pages.size]))
    return [(int(pages[a]), int(b - a)) for a, b in zip(starts, ends)]


def join(ranges: list[tuple[int, int]], gap: int = JOIN_GAP, most: int = MOST_RANGES) -> list[tuple[int, int]]:
    """Sorted byte ranges (offset, length) with gaps of at most *gap* joined; the gap doubles
    until at most *most* ranges are left."""
    while True:
        out: list[tuple[int, int]] = []
        for offset, length in sorted(ranges):
            if out and offset - (out[-1][0] + out[-1][1]) <= gap:
                last = out[-1]
                out[-1] = (last[0], max(last[1], offset + length - last[0]))
            else:
                out.append((offset, length))
        if len(out) <= most:
            return out
        gap, ranges = gap * 2, out


def resident_ranges(pids: Iterable[int]) -> dict[str, list[tuple[int, int]]]:
    """For each regular file *pids* map: the byte ranges (offset, length) whose pages any of
    them has mapped in, joined; a file mapped with none of its pages in memory has []."""
    ranges_of: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for pid in pids:
        mappings = _file_mappings(pid)
        if not mappings:
            continue
        try:
            pagemap = os.open("/proc/%d/pagemap" % pid, os.O_RDONLY)
        except OSError:
            continue  # gone, or not ours to read: its files are read whole, as before
        try:
            for path, start, end, offset in mappings:
                try:
                    present = _present_pages(pagemap, start, end)
                except OSError:
                    continue
                ranges_of[path] += [(offset + first * PAGE, count * PAGE) for first, count in _runs(present)]
        finally:
            os.close(pagemap)
    # join() sorts and merges what several mappings and processes hold of one file
    return {path: join(ranges) for path, ranges in ranges_of.items()}
