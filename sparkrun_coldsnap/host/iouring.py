"""Keep io_uring off while a workload that will be captured starts and runs.

CRIU cannot dump an io_uring instance, and event loops (libuv, used by the
engine's HTTP server) open one at start when the kernel allows it; an
environment variable did not stop it, the kernel switch did. The switch is
host-wide, so it is flipped only around a capture and put back afterwards;
a lock serializes captures so one does not restore the setting under another.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sparkrun_coldsnap.errors import CaptureError
from sparkrun_coldsnap.host import paths

SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


@contextlib.contextmanager
def io_uring_disabled() -> Iterator[None]:
    if not SYSCTL.exists():
        yield  # kernel without io_uring or without the switch: nothing to do
        return
    lock_path = paths.run_dir() / "io_uring.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = SYSCTL.read_text().strip()
        if old != "2":
            try:
                SYSCTL.write_text("2")
            except OSError as err:
                raise CaptureError(
                    "cannot disable io_uring for the capture (%s): run as root, or set kernel.io_uring_disabled=2 yourself" % err.strerror
                ) from err
        try:
            yield
        finally:
            if old != "2":
                SYSCTL.write_text(old)
    finally:
        os.close(fd)
