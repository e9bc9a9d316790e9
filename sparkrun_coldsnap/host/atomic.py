"""Nothing is written in place: stage beside the target, fsync, rename."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sparkrun_coldsnap.errors import StoreError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def explain_os_error(err: OSError, path: Path) -> str:
    """Turn the disk errors users hit into a message with the fix."""
    if err.errno == errno.ENOSPC:
        return "no space left on the device holding %s: free space or point the store elsewhere (coldsnap.capsule.store / --store)" % path
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "cannot write %s (%s): use a writable store directory (coldsnap.capsule.store / --store)" % (path, err.strerror)
    return "cannot write %s: %s" % (path, err.strerror or err)


def write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write *data* to *path* atomically: readers see the old file or the new one."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".%s." % path.name, suffix=".partial", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)
    except OSError as err:
        raise StoreError(explain_os_error(err, path)) from err


def owned_prefix(prefix: str) -> str:
    """A staging directory's name prefix carrying this process's PID: garbage collection tells
    the directories of live operations from those an interrupted one left behind."""
    return "%s%d-" % (prefix, os.getpid())


def owner_pid(name: str) -> int | None:
    """The PID an ``owned_prefix`` name carries, if any."""
    parts = name.split("-")
    for part in parts[1:]:
        if part.isdigit():
            return int(part)
    return None


@contextlib.contextmanager
def staging_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A private directory under *parent* that is removed unless kept.

    The caller publishes what it built by renaming out of it; whatever is left
    when the block ends, normally or not, is deleted.
    """
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=owned_prefix(prefix), dir=parent))
    except OSError as err:
        raise StoreError(explain_os_error(err, parent)) from err
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
