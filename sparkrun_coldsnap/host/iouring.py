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
    fd = _lock()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = _switch_off()
        try:
            yield
        finally:
            if old != "2":
                SYSCTL.write_text(old)
            _marker().unlink(missing_ok=True)
    finally:
        os.close(fd)


def hold_off() -> str | None:
    """Turn io_uring off until :func:`put_back_after_crash` puts it back: for a capture whose
    engine runs on another host, where no process of the capture stays to hold the switch.
    The value to put back is kept as a crashed capture's is, so a later ``recover`` finds it
    too. Returns the value before (None: no switch on this kernel)."""
    if not SYSCTL.exists():
        return None
    fd = _lock()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _switch_off()
    finally:
        os.close(fd)


def _switch_off() -> str:
    """io_uring off, the value before kept in the marker; the value before (under the lock)."""
    # A capture killed outright left its marker: the value before it is the one to keep.
    old = _marker_value() or SYSCTL.read_text().strip()
    if old != "2":
        _marker().write_text(old)
        try:
            SYSCTL.write_text("2")
        except OSError as err:
            _marker().unlink(missing_ok=True)
            raise CaptureError("cannot disable io_uring for the capture (%s): run as root, or set kernel.io_uring_disabled=2 yourself" % err.strerror) from err
    return old


def _lock() -> int:
    lock_path = paths.run_dir() / "io_uring.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)


def _marker() -> Path:
    """The setting to put back, kept while a capture holds io_uring off."""
    return paths.run_dir() / "io_uring.previous"


def _marker_value() -> str | None:
    try:
        value = _marker().read_text().strip()
    except OSError:
        return None
    return value if value in ("0", "1") else None


def put_back_after_crash() -> str | None:
    """Put the setting back if a capture killed outright left io_uring off; returns the value put back."""
    if not SYSCTL.exists():
        return None
    fd = _lock()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a capture is under way and holds it
        value = _marker_value()
        if value is None:
            return None
        SYSCTL.write_text(value)
        _marker().unlink(missing_ok=True)
        return value
    finally:
        os.close(fd)
