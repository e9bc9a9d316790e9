"""One process tree on this host, read from /proc: its processes, what they hold open or map, stopping it.

Drivers (what CRIU can capture) and launch units (starting and stopping engines)
both stand on this module; neither imports the other.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from sparkrun_coldsnap.errors import EngineError

SHARED_MEMORY_DIRS = ("/dev/shm/",)


def tree(root_pid: int) -> list[psutil.Process]:
    root = psutil.Process(root_pid)
    return [root] + root.children(recursive=True)


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants, root first."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def environ_and_argv(pid: int) -> tuple[dict[str, str], list[str]]:
    """The environment block and the argv *pid* was started with (empty where it is gone)."""
    try:
        raw_env = Path("/proc/%d/environ" % pid).read_bytes()
        raw_argv = Path("/proc/%d/cmdline" % pid).read_bytes()
    except OSError:
        return {}, []
    env = dict(entry.partition("=")[::2] for entry in raw_env.decode(errors="replace").split("\0") if "=" in entry)
    return env, [a for a in raw_argv.decode(errors="replace").split("\0") if a]


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` file after the command name (field 3 on: the name may
    hold spaces and parentheses, so it is cut at its last ``)``)."""
    with open(path) as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    """When *pid* started, in clock ticks since boot (``/proc/PID/stat``): what tells a process
    from a later one that got its PID. Stable, where a start time in seconds of the wall clock
    (psutil's ``create_time``) moves with the boot time each reader computes anew, by whole
    seconds when the host's clock is adjusted."""
    return int(_stat_fields("/proc/%d/stat" % pid)[19])  # field 22


def threads_stopped(pid: int) -> bool:
    """Whether every thread of *pid* is stopped (or dead); a process gone counts as stopped."""
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return True
    for tid in tasks:
        try:
            state = _stat_fields("/proc/%d/task/%s/stat" % (pid, tid))[0]
        except OSError:
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def inner_pid(pid: int) -> int:
    """*pid* as its innermost PID namespace numbers it (the last ``NSpid``; the host's own PID
    when it has no namespace of its own)."""
    with open("/proc/%d/status" % pid) as f:
        return int(next(line.split()[-1] for line in f if line.startswith("NSpid:")))


def fd_targets(pid: int) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    base = "/proc/%d/fd" % pid
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            out.append((int(name), os.readlink(os.path.join(base, name))))
        except OSError:
            continue
    return sorted(out)


def mapped_paths(pid: int) -> set[str]:
    out = set()
    try:
        with open("/proc/%d/maps" % pid) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    out.add(parts[5].rstrip("\n"))
    except OSError:
        pass
    return out


def shared_memory_files(root_pid: int) -> list[str]:
    """Files on shared-memory filesystems the tree has open or mapped (not deleted ones)."""
    out: set[str] = set()
    for p in tree(root_pid):
        candidates = {t for _, t in fd_targets(p.pid)} | mapped_paths(p.pid)
        for path in candidates:
            if path.startswith(SHARED_MEMORY_DIRS) and not path.endswith(" (deleted)") and Path(path).is_file():
                out.add(path)
    return sorted(out)


def users_of(paths: set[str], *, exclude: frozenset[int] = frozenset()) -> dict[str, list[str]]:
    """Which live processes (other than those in *exclude*) have any of *paths* open or mapped."""
    found: dict[str, list[str]] = {}
    if not paths:
        return found
    for p in psutil.process_iter(["pid", "name"]):
        if p.pid in exclude:
            continue
        try:
            held = {t for _, t in fd_targets(p.pid)} | mapped_paths(p.pid)
        except psutil.Error:
            continue
        for path in paths & held:
            found.setdefault(path, []).append("%d (%s)" % (p.pid, p.info["name"]))
    return found


def continue_tree(root_pid: int) -> None:
    """SIGCONT every process of the tree at *root_pid* (one left stopped by a restore); one
    already gone is skipped."""
    for pid in tree_pids(root_pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue


def kill_tree(root_pid: int, *, grace: float = 10.0) -> None:
    """Stop a unit: SIGTERM to its process group, SIGKILL what remains after *grace*.

    A namespace init ignores signals it has no handler for, so SIGKILL (which
    always reaches it, and takes the whole namespace with it) is the backstop.
    """
    pids = tree_pids(root_pid)
    if not pids:
        return
    shared = _shared_files(root_pid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(root_pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=wait)
        alive = [p for p in alive if _not_zombie(p)]
        if not alive:
            _remove_orphans(shared)
            return
    raise EngineError("processes %s of unit %d survived SIGKILL" % (", ".join(str(p.pid) for p in alive), root_pid))


def _not_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _shared_files(root_pid: int) -> list[str]:
    """The tree's shared-memory files, when they are the host's (a tree restored into a
    mount namespace of its own has a /dev/shm of its own, gone with its last process)."""
    try:
        if os.readlink("/proc/%d/ns/mnt" % root_pid) != os.readlink("/proc/self/ns/mnt"):
            return []
        return shared_memory_files(root_pid)
    except (psutil.Error, OSError):
        return []


def _remove_orphans(paths: list[str]) -> None:
    """Shared-memory files the stopped tree leaked (a killed engine does not clean up)."""
    held = users_of(set(paths))
    for path in paths:
        if path not in held:
            try:
                os.unlink(path)
            except OSError:
                pass


def leaked_semaphores(*, since: float, uid: int, shm: Path = Path("/dev/shm")) -> list[Path]:
    """Python's named semaphores (``sem.mp-*``) of user *uid* made since *since* (a time) that no
    process holds: a tree that spawns with multiprocessing leaves its resource tracker to unlink
    them, and a tree that ends by SIGKILL (a capture's dump) ends that tracker too."""
    try:
        names = [n for n in os.listdir(shm) if n.startswith("sem.mp-")]
    except OSError:
        return []
    candidates = set()
    for name in names:
        try:
            st = (shm / name).stat()
        except OSError:
            continue
        if st.st_uid == uid and st.st_ctime >= since:
            candidates.add(str(shm / name))
    held = users_of(candidates)
    return sorted(Path(p) for p in candidates - set(held))


def remove_leaked_semaphores(*, since: float, uid: int, shm: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink what :func:`leaked_semaphores` finds; the paths removed."""
    removed = []
    for path in leaked_semaphores(since=since, uid=uid, shm=shm):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed
