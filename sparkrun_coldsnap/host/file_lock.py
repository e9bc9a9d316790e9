"""Locks on files that serialize changes across processes and threads: ``flock`` through ``filelock``.

Each lock file stays where it is after a release (removing it would let a process that opened
the old file and one that creates a new one both hold "the" lock), and a file system without
``flock`` is an error rather than a quiet fall back to a weaker lock. One object per lock file
in the process, so that a nested acquire in its holder counts instead of waiting for itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import Timeout, UnixFileLock

__all__ = ["Timeout", "file_lock"]


def file_lock(path: Path, *, mode: int, per_thread: bool) -> UnixFileLock:
    """The lock on *path* (made with *mode* if missing); reentrant in its holding thread with
    *per_thread*, else in its holding process."""
    return UnixFileLock(os.path.realpath(path), mode=mode, thread_local=per_thread, is_singleton=True, preserve_lock_file=True, fallback_to_soft=False)
