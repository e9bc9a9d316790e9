"""Major page faults: pages a process waited for from the disk. A restore on a node with
nothing prepared should have few: every one waits behind whatever else the disk is reading,
the weights' copy most of all."""

from __future__ import annotations

import resource


def of_children() -> int:
    """Major faults of this process's children that ended and were waited for, so far."""
    return int(resource.getrusage(resource.RUSAGE_CHILDREN).ru_majflt)


def of_self() -> int:
    """Major faults of this process, every thread, so far."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
