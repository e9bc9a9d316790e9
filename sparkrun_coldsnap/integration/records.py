"""Workloads recorded the way sparkrun's local executor records its own.

sparkrun finds a host-process workload (``status``, ``stop``, ``logs``, eviction) only
through its executor's records: a pidfile plus an owner file under
``~/.cache/sparkrun/local/pids``, for a process that leads its own process group. A
restored tree is registered the same way. A private format: tested against the
pinned sparkrun.
"""

from __future__ import annotations

import fnmatch
import os
import re
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


#: sparkrun's workload names: ``<namespace>_<intent>_<placement token>_<role>``
_NAME = re.compile(r"^(?P<intent>.+)_(?P<token>[0-9a-f]+)_(?P<role>solo|node_\d+)$")


def intent_pattern(name: str) -> str:
    """The glob matching every name of *name*'s intent (recipe, runtime, model, port, parallelism).

    A status-aware scheduler (sparkrun's default for a new cluster) draws a new placement token on
    every plan, so the same recipe run again gets another name; the rest of the name is stable.
    """
    m = _NAME.match(name)
    return "%s_*_%s" % (m["intent"], m["role"]) if m else name


def same_intent(name: str, other: str) -> bool:
    return fnmatch.fnmatchcase(other, intent_pattern(name))


def recorded_names(pattern: str) -> list[str]:
    """The workload names sparkrun's local executor has a record of here matching the glob *pattern*."""
    pidfile, _ = local_record_paths("")
    return sorted(p.name[: -len(".pid")] for p in pidfile.parent.glob(pattern + ".pid"))


def live_of_intent(name: str) -> list[str]:
    """The workloads recorded here under a name of *name*'s intent whose process still runs."""
    return [n for n in recorded_names(intent_pattern(name)) if registered_pid(n) is not None]


def replaced_workload(name: str) -> str | None:
    """The running workload a run named *name* replaces: the one recorded under that name, or
    else the one running of the same intent (it holds the same port); None when there is none
    or several."""
    if registered_pid(name) is not None:
        return name
    live = live_of_intent(name)
    return live[0] if len(live) == 1 else None


def unregister_local(name: str) -> None:
    """Drop sparkrun's record of workload *name* (its process now recorded under another name)."""
    pidfile, _ = local_record_paths(name)
    for path in (pidfile, pidfile.with_name(pidfile.name + ".owner")):
        path.unlink(missing_ok=True)


def adopt_log(old: str, new: str) -> None:
    """Workload *new*'s log is *old*'s, which its running processes still write: linked, so that
    ``sparkrun logs`` of the new name reads it."""
    _, old_log = local_record_paths(old)
    _, new_log = local_record_paths(new)
    if old_log.exists() and not new_log.exists():
        new_log.parent.mkdir(parents=True, exist_ok=True)
        new_log.symlink_to(old_log)


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
