"""Workloads recorded the way sparkrun's local executor records its own.

sparkrun finds a host-process workload (``status``, ``stop``, ``logs``, eviction) only
through its executor's records: a pidfile plus an owner file under
``~/.cache/sparkrun/local/pids``, for a process that leads its own process group. A
restored tree is registered the same way. A private format: tested against the
pinned sparkrun.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkrun_coldsnap.host.atomic import write_bytes


def _expand_home(path: str) -> Path:
    return Path(path.replace("$HOME", os.path.expanduser("~"), 1))


def local_record_paths(name: str) -> tuple[Path, Path]:
    """(pidfile, logfile) sparkrun's local executor uses for workload *name*."""
    from sparkrun.orchestration.executors.local import default_log_dir, default_pid_dir

    return _expand_home(default_pid_dir()) / (name + ".pid"), _expand_home(default_log_dir()) / (name + ".log")


def register_local(name: str, pid: int) -> Path:
    """Record *pid* (a process-group leader) as workload *name*: status/stop/logs then see it."""
    from sparkrun.core.application_profile import get_application_profile

    pidfile, _ = local_record_paths(name)
    write_bytes(pidfile.with_name(pidfile.name + ".owner"), get_application_profile().id.encode())
    write_bytes(pidfile, ("%d\n" % pid).encode())
    return pidfile


def registered_pid(name: str) -> int | None:
    """The process sparkrun's local executor has recorded as workload *name*, if it still runs.

    Only the very process recorded: a group leader started before its record was written (a PID
    reused by another process since would be younger than the record).
    """
    import psutil

    pidfile, _ = local_record_paths(name)
    try:
        pid = int(pidfile.read_text().strip())
        recorded = pidfile.stat().st_mtime
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE or os.getpgid(pid) != pid or p.create_time() > recorded + 1.0:
            return None
        return pid
    except (OSError, ValueError, psutil.Error):
        return None
