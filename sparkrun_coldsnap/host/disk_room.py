"""Room on disk for a capture, checked just before the dump from what the processes hold.

A dump writes every private and shared-memory page of the tree, and packing then writes
the capsule's layers beside the images before they go: a disk that fills half-way
through fails the capture after its longest steps. The memory the tree holds (its
proportional share of anonymous and shared-memory pages, swapped out ones included)
is what CRIU will write, near enough to refuse early with the numbers.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

FIELDS = ("Pss_Anon:", "Pss_Shmem:", "SwapPss:")


def dump_estimate(pids: Iterable[int], proc: Path = Path("/proc")) -> int:
    """Bytes a dump of *pids* will write, from their smaps_rollup (0 for a process gone meanwhile)."""
    total = 0
    for pid in pids:
        try:
            text = (proc / str(pid) / "smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(FIELDS):
                total += int(line.split()[1]) * 1024
    return total


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the file system that holds (or will hold) *path*."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def shortfall(estimate: int, places: Iterable[tuple[Path, float, str]]) -> str | None:
    """The first place (directory, how many copies of *estimate* it must take, what goes there)
    without room, as one line; None when all have room."""
    for path, copies, what in places:
        need, free = int(estimate * copies), free_bytes(path)
        if free < need:
            return "not enough disk space for the capture: %s needs about %.1f GB in %s, %.1f GB are free there" % (what, need / 1e9, path, free / 1e9)
    return None
