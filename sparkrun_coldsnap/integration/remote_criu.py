"""CRIU run on a cluster's hosts through sparkrun's transport: a unit is dumped and restored on
the host it runs on, in that host's namespaces.

A unit of a multi-host workload is a process tree on another host: CRIU has to run there,
beside it (a dump reads the tree's ``/proc``, its sockets and its mounts; a restore recreates
them in that host's kernel). The plugin never opens SSH itself: the command goes through
sparkrun's session of the cluster (``integration/transport.py``), so it runs as the cluster's
user in a login session of that host.

The ranks of a distributed engine hold TCP connections to each other (gloo's pairs, vLLM's
ZMQ queues). ``--tcp-established`` dumps each side's sockets in repair mode (sequence numbers,
queues) and restores them as they were; CRIU's network lock (iptables rules in the host's
network namespace, left in place after a dump that ends the tree, removed at the end of the
restore) keeps each host's side silent in between, so a packet from the other side finds no
closed socket to answer with a reset. Both ends must come back from dumps of the same
moment: the coordinator dumps every unit before any is restored.

CRIU is the one ``sparkrun coldsnap setup --criu`` installs: the same command on every host
(the plugin and its CRIU are installed on every host of a cluster, as sparkrun is).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sparkrun_coldsnap.api import UnitOnHost
from sparkrun_coldsnap.errors import CaptureError, RestoreError, ToolError
from sparkrun_coldsnap.integration.transport import ClusterHosts

FLAGS = ("--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", "256M")
TCP_FLAGS = ("--tcp-established",)
DUMP_LOG, RESTORE_LOG = "dump.log", "restore.log"


@dataclass(frozen=True)
class RemoteStep:
    """What one CRIU call on one host took."""

    host: str
    seconds: float


class RemoteCriu:
    """CRIU on the hosts of one cluster session."""

    def __init__(self, hosts: ClusterHosts, criu_argv: Sequence[str]) -> None:
        self.hosts = hosts
        self.argv = tuple(str(a) for a in criu_argv)

    def _log_tail(self, host: str, log: str) -> str:
        # CRIU's one always-present harmless line would otherwise be what a reader sees first.
        script = "grep -v RLIMIT_NOFILE %s 2>/dev/null | grep Error | tail -n 3" % shlex.quote(log)
        done = self.hosts.run(host, ["sh", "-c", script], timeout=30, check=False)
        return " | ".join(line.strip() for line in done.stdout.splitlines()) or "its log has no error line"

    def dump(self, host: str, unit: str, pid: int, images: str, *, tcp: bool, leave_running: bool = False, timeout: float = 900.0) -> RemoteStep:
        """Dump the tree rooted at *pid* on *host* into *images* (a directory there)."""
        argv = [*self.argv, "dump", "-t", str(pid), "-D", images, "-o", DUMP_LOG, *FLAGS, *(TCP_FLAGS if tcp else ())]
        if leave_running:
            argv.append("--leave-running")
        t0 = time.monotonic()
        try:
            self.hosts.run(host, ["mkdir", "-p", images], timeout=60)
            done = self.hosts.run(host, argv, timeout=timeout, check=False)
        except ToolError as err:
            raise CaptureError("dumping unit %s on host %s failed: %s" % (unit, host, err)) from err
        if done.returncode != 0:
            how = "was killed" if done.returncode in (137, 143) or done.returncode < 0 else "failed (exit %d)" % done.returncode
            raise CaptureError("dumping unit %s on host %s: criu %s: %s" % (unit, host, how, self._log_tail(host, "%s/%s" % (images, DUMP_LOG))))
        return RemoteStep(host, time.monotonic() - t0)

    def restore(self, host: str, unit: str, images: str, *, tcp: bool, timeout: float = 900.0) -> RemoteStep:
        """Restore the tree dumped in *images* on *host*, detached (``-d``)."""
        argv = [*self.argv, "restore", "-d", "-D", images, "-o", RESTORE_LOG, *FLAGS, *(TCP_FLAGS if tcp else ())]
        t0 = time.monotonic()
        try:
            done = self.hosts.run(host, argv, timeout=timeout, check=False)
        except ToolError as err:
            raise RestoreError("restoring unit %s on host %s failed: %s" % (unit, host, err)) from err
        if done.returncode != 0:
            raise RestoreError("restoring unit %s on host %s: criu failed (exit %d): %s" % (unit, host, done.returncode, self._log_tail(host, "%s/%s" % (images, RESTORE_LOG))))
        return RemoteStep(host, time.monotonic() - t0)


class CriuCut:
    """A coordinated checkpoint's steps (``controller/cut.py``) done with
    CRIU run directly on each host: trees stopped and continued by process group."""

    def __init__(self, criu: RemoteCriu, *, tcp: bool = True) -> None:
        self.criu = criu
        self.tcp = tcp

    def _signal(self, u: UnitOnHost, sig: str) -> None:
        self.criu.hosts.run(u.host, ["kill", "-%s" % sig, "--", "-%d" % u.root_pid], timeout=60)

    def stop(self, u: UnitOnHost) -> None:
        self._signal(u, "STOP")

    def resume(self, u: UnitOnHost) -> None:
        self._signal(u, "CONT")

    def dump(self, u: UnitOnHost) -> RemoteStep:
        return self.criu.dump(u.host, u.unit, u.root_pid, u.images, tcp=self.tcp, leave_running=True)

    def discard(self, u: UnitOnHost) -> None:
        self.criu.hosts.run(u.host, ["rm", "-rf", "--", u.images], timeout=120, check=False)
