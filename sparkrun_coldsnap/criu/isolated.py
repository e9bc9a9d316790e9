"""Restore a host-process tree into PID, mount and network namespaces of its own.

A tree captured in the host's namespaces needs, to come back there, its
captured PIDs, its ``/dev/shm`` names and its port free on the host: the very
things the workload being replaced, or a second restore of the same capsule,
holds. Restored through :mod:`sparkrun_coldsnap.criu.namespace_keeper` it
gets them all in namespaces of its own, and the recipe's port is forwarded to
the captured one. Nothing about namespaces is in the images: the same capsule
restores either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from sparkrun_coldsnap.criu import page_fill
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu, how_it_ended, log_tail
from sparkrun_coldsnap.criu.tree import BASE_FLAGS, RESTORE_LOG, TCP_FLAGS
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.progress import Report as Progress

KEEPER = "sparkrun_coldsnap.criu.namespace_keeper"


def inner_port(unit: UnitImage, host_port: int | None) -> int | None:
    """The captured port the recipe's *host_port* is forwarded to (None: no forwarding)."""
    if host_port is None or host_port in unit.listening_ports or not unit.listening_ports:
        return host_port
    return unit.listening_ports[0]


def restore(
    criu: Criu, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, host_port: int | None, owned_dir: Path | None = None,
    details: dict[str, Any] | None = None,
) -> tuple[int, int, bool]:  # fmt: skip
    """Restore *unit* in namespaces of its own; returns the host PIDs of its root and of its
    keeper, and whether *owned_dir* was handed over to the lazy-pages daemon.

    With *host_port* the tree gets a network namespace too, and the keeper forwards that
    port of the host to the captured one; without, it serves on the host's network.

    Without a memory fill, memory comes back on demand where the host can: the ``criu lazy-pages`` daemon runs in
    the host's namespaces and listens on a socket among the images; the restore inside
    reaches it through the keeper's descriptor of the images directory (a socket is found
    by its inode, whatever mount namespace the path is walked from), and the pages the
    restored tasks fault on are served from the images the daemon reads. It removes
    *owned_dir* once every page has moved.

    The tree comes back stopped. Images split for a fill
    (:mod:`sparkrun_coldsnap.criu.page_fill`) are filled from this side, the host's: the
    fill finds each process by the PID it has inside the namespace, the one the images name.
    Every process gets back the AMX tile permission CRIU does not restore
    (:mod:`sparkrun_coldsnap.host.xstate_perm`) before the tree is continued. *details*
    receives the timings.
    """
    filling = page_fill.fill_planned(images)
    lazy = not filling and criu_tree.lazy_pages_supported(criu)
    # Not in memory staging: the keeper mounts a /dev/shm of the workload's own over the host's.
    pidfile = paths.run_dir() / ("restore-%d-%s.pid" % (os.getpid(), unit.name))
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The keeper adds ``restore -D``: it reaches the images through a descriptor.
    args = ["-d", "-o", RESTORE_LOG, "--pidfile", str(pidfile), *BASE_FLAGS]
    args += list(TCP_FLAGS if unit.tcp_established else ())
    daemon = criu_tree.start_lazy_daemon(criu, images, owned_dir) if lazy else None
    if daemon is not None:
        args.append("--lazy-pages")
    args.append("--leave-stopped")  # every path: no process runs before it has its AMX permission back
    spec = {
        "criu_argv": list(criu.argv),
        "restore_args": args,
        "env": settings.current().child_env(),
        "images": str(images),
        "pidfile": str(pidfile),
        "log_path": str(log_path),
        "log_resource": unit.log_resource,
        "shared_files": [f.model_dump() for f in unit.shared_files],
        "host_port": host_port,
        "inner_port": inner_port(unit, host_port),
    }
    progress("criu restore in namespaces of its own" + (" (port %d)" % host_port if host_port else "") + (", memory on demand" if daemon else ""))
    t = time.monotonic()
    # The keeper's own complaints (it has no other voice once this process is gone) go to the unit's log.
    with open(log_path, "ab") as log:
        keeper = subprocess.Popen(
            [sys.executable, "-m", KEEPER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env=settings.current().child_env(), start_new_session=True, close_fds=True,
        )  # fmt: skip
    assert keeper.stdin is not None and keeper.stdout is not None
    keeper.stdin.write(json.dumps(spec))
    keeper.stdin.close()
    line = keeper.stdout.readline()
    keeper.stdout.close()
    pidfile.unlink(missing_ok=True)
    try:
        said = json.loads(line)
    except ValueError:
        said = {"error": "the namespace keeper ended (exit %s)" % keeper.wait()}
    if "root_pid" not in said:
        keeper.wait()
        if daemon is not None:
            criu_tree.stop_lazy_daemon(daemon)
        words = said["error"].split()
        if len(words) == 2 and words[0] == "criu" and words[1].lstrip("-").isdigit():
            ended = "criu restore of unit %s in its own namespaces %s" % (unit.name, how_it_ended(int(words[1])))
            raise RestoreError("%s (after %.1f s): %s" % (ended, time.monotonic() - t, log_tail(images / RESTORE_LOG)))
        raise RestoreError("criu restore of unit %s in its own namespaces failed after %.1f s: %s" % (unit.name, time.monotonic() - t, said["error"].strip()))
    if details is not None:
        details["criu_restore_seconds"] = round(time.monotonic() - t, 4)
    # The keeper outlives this process (it forwards the port while the tree lives); nothing waits
    # for it here, so do not leave a Popen that would warn about it.
    keeper.returncode = 0
    handed = daemon is not None and owned_dir is not None
    if handed and daemon is not None and daemon.poll() is not None and owned_dir is not None:
        # A small tree's pages can all be delivered before criu restore has finished writing
        # its statistics there: the daemon's removal then raced it, so remove again.
        paths.remove_staging(owned_dir)
    root = int(said["root_pid"])
    # A fill that fails ends the tree, and the keeper with it (it ends with its root).
    criu_tree.continue_restored(unit, images, root, filling=filling, progress=progress, details=details)
    return root, int(said["keeper_pid"]), handed


def keeper_of(root_pid: int) -> int | None:
    """The keeper of a tree restored here (the parent of its namespace's init), if any."""
    try:
        init = psutil.Process(root_pid).parent()
        keeper = init.parent() if init is not None else None
    except psutil.Error:
        return None
    if keeper is None:
        return None
    try:
        cmd = keeper.cmdline()
    except psutil.Error:
        return None
    return keeper.pid if KEEPER in cmd else None
