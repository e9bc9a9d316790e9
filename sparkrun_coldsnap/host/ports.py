"""Who holds a TCP port: a restore re-binds the captured listening socket."""

from __future__ import annotations

import socket
import time

import psutil


def port_holder(port: int) -> str | None:
    """``None`` if nothing listens on *port*, else a description of the holder."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid:
                try:
                    return "pid %d (%s)" % (c.pid, psutil.Process(c.pid).name())
                except psutil.Error:
                    return "pid %d" % c.pid
            return "another process"
    # A socket in another network namespace or of another user: try binding.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return "another process"
    return None


def port_holder_settled(port: int, wait: float = 5.0) -> str | None:
    """:func:`port_holder`, given *wait* seconds for a just-stopped holder to let go
    (a workload's port forwarder closes its socket when the tree it serves has ended)."""
    deadline = time.monotonic() + wait
    while (holder := port_holder(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder
