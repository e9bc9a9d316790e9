"""Host-process launch units: an engine command run as its own process tree.

The engine leads its own session and process group (what sparkrun's local
executor expects of a workload it tracks), with no parent-death signal armed
(CRIU would restore it too and kill the restored tree when CRIU exits).

Output goes to a log file opened in append mode; at restore the driver hands
CRIU a fresh log (``--inherit-fd``) because CRIU refuses a file whose size
changed since the dump.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.logfile import last_line
from sparkrun_coldsnap.host.process_tree import kill_tree


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

    def log_location(self) -> str:
        return str(self.log_path)

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
