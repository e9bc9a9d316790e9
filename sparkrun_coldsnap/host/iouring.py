"""Keep io_uring off while a workload that will be captured starts and runs.

CRIU cannot dump an io_uring instance, and event loops (libuv, used by the
engine's HTTP server) open one at start when the kernel allows it; an
environment variable did not stop it, the kernel switch did. The switch is
host-wide, so it is flipped only around a capture and put back afterwards.

Several captures may hold it at once on one host: captures under different
``COLDSNAP_HOME`` folders, a capture here beside a capture of a workload on
several hosts whose coordinator holds it from elsewhere. So every one that
needs it off registers as a holder, in a folder of the host's (not of a home),
and the setting from before is put back only when the last holder lets go. A
holder here is a process: one killed outright stops counting as soon as anyone
looks. A holder on another host's behalf (``hold_off``) is known by a token,
and stops counting when it lets go or after :data:`REMOTE_HOLD_SECONDS`; or,
where the coordinator that asked for it ran on this very host (one kernel, one
process namespace: a cluster of one machine, or hosts that are namespaces of
it), as soon as that process is gone, like a holder here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from sparkrun_coldsnap.errors import CaptureError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.facts import boot_id
from sparkrun_coldsnap.host.file_lock import file_lock
from sparkrun_coldsnap.host.process_tree import start_ticks

SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")
#: the host's own state, shared by every home; the plugin's run folder where /run is not writable
HOST_STATE = Path("/run/sparkrun-coldsnap")
#: a hold on another host's behalf outlives any capture: the engine's start and the dump are bounded well below it
REMOTE_HOLD_SECONDS = 6 * 3600


def state_dir() -> Path:
    base = HOST_STATE if os.access(HOST_STATE.parent, os.W_OK) else paths.run_dir()
    d = base / "io_uring"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def io_uring_disabled() -> Iterator[None]:
    """io_uring off for the time of the block, held by this process."""
    if not SYSCTL.exists():
        yield  # kernel without io_uring or without the switch: nothing to do
        return
    holder = "local-%d-%d-%s" % (os.getpid(), start_ticks(os.getpid()), uuid.uuid4().hex[:8])
    _acquire(holder)
    try:
        yield
    finally:
        _release(holder)


def coordinator() -> dict[str, str | int]:
    """Who asks for a hold: this process, with what tells whether a host can see it (its
    kernel's boot and its process namespace) and its start, so a reused pid is not it."""
    pid = os.getpid()
    return {"boot_id": boot_id(), "pid_namespace": _pid_namespace(), "pid": pid, "start_ticks": start_ticks(pid)}


def hold_off(token: str, by: dict[str, str | int] | None = None) -> str | None:
    """Turn io_uring off on behalf of a capture coordinated from another host, until
    :func:`let_go` with the same *token*; *by* (:func:`coordinator` of the asking process)
    lets the hold end with that process where it ran on this host. Returns the value
    before (None: no switch)."""
    if not SYSCTL.exists():
        return None
    return _acquire("remote-" + _checked(token), {"since": time.time(), "coordinator": by})


def let_go(token: str) -> str | None:
    """End the hold of *token*; returns the value put back, if this was the last holder."""
    if not SYSCTL.exists():
        return None
    return _release("remote-" + _checked(token))


def put_back_after_crash() -> str | None:
    """Put the setting back if the captures that turned io_uring off are all gone (killed
    outright, their holds never let go); returns the value put back."""
    if not SYSCTL.exists():
        return None
    with _locked() as d:
        return _put_back_if_unheld(d)


def holders() -> list[str]:
    """The holders counted now (those gone are not)."""
    with _locked() as d:
        return sorted(p.name for p in d.glob("holder-*") if _alive(p))


def _checked(token: str) -> str:
    if not token or not all(c.isalnum() or c in "-_" for c in token):
        raise CaptureError("io_uring hold token %r: use letters, digits, '-' and '_'" % token)
    return token


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    """The host's state folder, under its lock: held only while holders and the setting change."""
    d = state_dir()
    with file_lock(d / "lock", mode=0o644, per_thread=True):
        yield d


def _acquire(holder: str, record: dict | None = None) -> str:
    with _locked() as d:
        _prune(d)
        # A capture killed outright left the value from before it: that one is to put back.
        old = _marker_value(d) or SYSCTL.read_text().strip()
        if old != "2":
            (d / "previous").write_text(old)
            try:
                SYSCTL.write_text("2")
            except OSError as err:
                if not any(d.glob("holder-*")):
                    (d / "previous").unlink(missing_ok=True)
                raise CaptureError("cannot disable io_uring for the capture (%s): run as root, or set kernel.io_uring_disabled=2 yourself" % err.strerror) from err
        (d / ("holder-" + holder)).write_text(json.dumps(record or {"since": time.time()}))
        return old


def _release(holder: str) -> str | None:
    with _locked() as d:
        (d / ("holder-" + holder)).unlink(missing_ok=True)
        return _put_back_if_unheld(d)


def _put_back_if_unheld(d: Path) -> str | None:
    _prune(d)
    if any(d.glob("holder-*")):
        return None
    value = _marker_value(d)
    if value is None:
        return None
    SYSCTL.write_text(value)
    (d / "previous").unlink(missing_ok=True)
    return value


def _prune(d: Path) -> None:
    for p in d.glob("holder-*"):
        if not _alive(p):
            p.unlink(missing_ok=True)


def _alive(p: Path) -> bool:
    kind, _, rest = p.name[len("holder-") :].partition("-")
    if kind == "remote":
        try:
            record = json.loads(p.read_text())
            since = float(record["since"] if isinstance(record, dict) else record)  # a bare time: written before coordinators were recorded
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if time.time() - since >= REMOTE_HOLD_SECONDS:
            return False
        by = record.get("coordinator") if isinstance(record, dict) else None
        return _coordinator_alive(by) if isinstance(by, dict) else True
    try:
        pid, ticks, _ = rest.split("-", 2)
        return start_ticks(int(pid)) == int(ticks)
    except (OSError, ValueError):
        return False  # the process is gone, or a name this version did not write


def _coordinator_alive(by: dict) -> bool:
    """False only where the coordinator ran under this kernel and in this process namespace
    and is gone (killed outright, its let-go never sent); elsewhere it cannot be seen from
    here, and the hold's time bounds it."""
    if by.get("boot_id") != boot_id() or by.get("pid_namespace") != _pid_namespace():
        return True
    try:
        return start_ticks(int(by["pid"])) == int(by["start_ticks"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _pid_namespace() -> str:
    return os.readlink("/proc/self/ns/pid")


def _marker_value(d: Path) -> str | None:
    try:
        value = (d / "previous").read_text().strip()
    except OSError:
        return None
    return value if value in ("0", "1") else None
