"""Host-process launch units: an engine command run as its own process tree.

The engine leads its own session and process group (what sparkrun's local
executor expects of a workload it tracks), with no parent-death signal armed
(CRIU would restore it too and kill the restored tree when CRIU exits).

Output goes to a log file opened in append mode; at restore the driver hands
CRIU a fresh log (``--inherit-fd``) because CRIU refuses a file whose size
changed since the dump.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import psutil

from sparkrun_coldsnap.errors import EngineError, ToolError


@dataclass
class StartedUnit:
    """A unit started by this process (or restored): the root of the engine tree."""

    root_pid: int
    launcher: subprocess.Popen | None
    log_path: Path

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.root_pid)
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def stop(self, grace: float = 10.0) -> None:
        kill_tree(self.root_pid, grace=grace)

    def tail(self) -> str:
        """The last non-empty line of the unit's output."""
        return last_line(self.log_path)

    def reap(self, timeout: float = 10.0) -> None:
        if self.launcher is not None:
            try:
                self.launcher.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait(timeout=timeout)


def start_unit(command: str, *, env: Mapping[str, str], log_path: Path, cwd: str | None = None) -> StartedUnit:
    """Start *command* (a shell command line) detached, output appended to *log_path*."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # exec: the engine itself leads the session Popen creates, not a shell waiting on it.
    argv = ["bash", "-c", "exec " + command]
    with open(log_path, "ab", buffering=0) as log:
        try:
            launcher = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                close_fds=True,
                # Its own session: the unit outlives the CLI that started it
                # and is not hit by signals aimed at the CLI's terminal.
                start_new_session=True,
            )
        except FileNotFoundError as err:
            raise ToolError("cannot start the engine: %s not found" % argv[0]) from err
    return StartedUnit(launcher.pid, launcher, log_path)


def last_line(path: Path, window: int = 4096) -> str:
    """The last non-empty line of a log file (read from its end), or "" when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - window, 0))
            lines = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants, root first."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


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


def describe(command: str) -> str:
    return shlex.split(command)[0] if command.strip() else "(empty command)"


def _shared_files(root_pid: int) -> list[str]:
    from sparkrun_coldsnap.drivers.tree_inspect import shared_memory_files

    try:
        return shared_memory_files(root_pid)
    except psutil.Error:
        return []


def _remove_orphans(paths: list[str]) -> None:
    """Shared-memory files the stopped tree leaked (a killed engine does not clean up)."""
    from sparkrun_coldsnap.drivers.criu_tree import users_of

    held = users_of(set(paths))
    for path in paths:
        if path not in held:
            try:
                os.unlink(path)
            except OSError:
                pass
