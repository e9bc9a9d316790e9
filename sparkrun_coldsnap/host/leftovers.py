"""What an operation killed outright (kill -9 of the plugin) leaves on the host, found and undone.

A capture starts an engine it always stops, and turns io_uring off host-wide for the
duration. A process that is killed cannot do either, so both are recorded while they last:
the engine as ``run/owned/<pid>.json`` (its owner's PID, its root PID and start time), the
io_uring setting as the value to put back. The next capture, and ``gc``, call ``recover``: an
engine whose owner is gone is stopped (only if its root is still the very process recorded),
and the setting is put back when no capture holds it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.process_tree import kill_tree


def _owned_dir() -> Path:
    return paths.run_dir() / "owned"


def adopt(root_pid: int, what: str) -> Path:
    """Record that this process started *root_pid* and will stop it."""
    d = _owned_dir()
    d.mkdir(parents=True, exist_ok=True)
    record = d / ("%d.json" % root_pid)
    try:
        started = psutil.Process(root_pid).create_time()
    except psutil.Error:
        started = 0.0
    record.write_text(json.dumps({"owner": os.getpid(), "root": root_pid, "create_time": started, "what": what}))
    return record


def release(root_pid: int) -> None:
    (_owned_dir() / ("%d.json" % root_pid)).unlink(missing_ok=True)


@dataclass(frozen=True)
class Recovered:
    stopped: tuple[str, ...]
    io_uring: str | None
    temp_files: tuple[Path, ...] = ()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_orphans() -> tuple[str, ...]:
    """Stop engines whose owner is gone; returns what was stopped, in words."""
    d = _owned_dir()
    if not d.is_dir():
        return ()
    stopped = []
    for record in sorted(d.glob("*.json")):
        try:
            doc = json.loads(record.read_text())
            owner, root, started = int(doc["owner"]), int(doc["root"]), float(doc["create_time"])
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            continue
        if _alive(owner):
            continue
        try:
            same = abs(psutil.Process(root).create_time() - started) < 1.0
        except psutil.Error:
            same = False
        if same and _alive(root):
            kill_tree(root, grace=5.0)
            stopped.append("%s (pid %d, started by pid %d, which is gone)" % (doc.get("what", "engine"), root, owner))
        record.unlink(missing_ok=True)
    return tuple(stopped)


def recover() -> Recovered:
    """Undo what operations killed outright left: their engines, the io_uring setting, and
    the files stopped engines left in /tmp."""
    from sparkrun_coldsnap.host import engine_temp
    from sparkrun_coldsnap.host.iouring import put_back_after_crash

    stopped = stop_orphans()
    return Recovered(stopped, put_back_after_crash(), tuple(engine_temp.sweep()))
