"""A workload's TCP connections ended at once, before it is stopped for a restore of the same capsule.

A restore brings a rank's connections back with the very addresses and ports they had at
capture. When the workload it replaces came from the same capsule, it holds those same
connections; stopped the ordinary way, one end of each lingers in its host's kernel for up to
a minute (TIME_WAIT), and a segment from the restored peer can reach that leftover instead of
the restored socket, which answers with a reset: on the two test hosts, about one restore in
five lost a connection between ranks that way. Aborting the connections first (``ss -K``, the
kernel's socket destroy) sends a reset and leaves nothing behind on either end.
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil

from sparkrun_coldsnap.host.runner import run


def held_connections(pids: Iterable[int]) -> set[tuple[str, int, str, int]]:
    """The TCP connections the processes hold (local address, port, peer address, port); a
    process that is gone by then holds none."""
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.raddr and c.status != psutil.CONN_LISTEN:
                out.add((c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port))
    return out


def _endpoint(ip: str, port: int) -> str:
    return "[%s]:%d" % (ip, port) if ":" in ip else "%s:%d" % (ip, port)


def abort(connections: Iterable[tuple[str, int, str, int]]) -> list[str]:
    """End each connection at once on this host (a reset to the peer, no TIME_WAIT here);
    those ``ss`` could not end, one line each (a kernel without socket destroy, say)."""
    problems = []
    for lip, lport, rip, rport in sorted(connections):
        done = run(["ss", "-K", "-tn", "src", _endpoint(lip, lport), "dst", _endpoint(rip, rport)], timeout=30, check=False)
        if done.returncode != 0:
            problems.append("%s -> %s: ss -K exited %d" % (_endpoint(lip, lport), _endpoint(rip, rport), done.returncode))
    return problems
