"""Read a running process tree from /proc and list what CRIU cannot capture.

CRIU's own errors for these cases are cryptic (an io_uring fd fails as
"send_fds failed (-22)") and arrive after the tree was frozen, so capture
checks first and names each offending process, descriptor and the fix.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from dataclasses import dataclass

import psutil

from sparkrun_coldsnap.host.process_tree import SHARED_MEMORY_DIRS, fd_targets, mapped_paths, tree

# Character devices any process may hold that CRIU restores by path.
# "/dev/zero (deleted)" is how shared anonymous memory shows among mappings; CRIU saves it.
HARMLESS_DEVICES = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx", "/dev/zero (deleted)"}

_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2", "06": "TIME_WAIT",
               "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}  # fmt: skip


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str


def _label(p: psutil.Process) -> str:
    try:
        return "pid %d (%s)" % (p.pid, p.name())
    except psutil.Error:
        return "pid %d" % p.pid


def _addr(hexaddr: str) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:
        words = struct.unpack("<4I", raw)
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
    return ip, int(port, 16)


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """Every TCP socket of the network namespace *pid* lives in."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, name)) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    out.append(TcpSocket(int(cols[9]), _addr(cols[1]), _addr(cols[2]), _TCP_STATES.get(cols[3], cols[3])))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return out


def _socket_inode(target: str) -> int | None:
    if target.startswith("socket:[") and target.endswith("]"):
        return int(target[8:-1])
    return None


# A client that just hung up leaves the server's end in CLOSE_WAIT until the server
# reads the end of the stream and closes it, a moment later (the validation request
# itself, say). Such connections are waited out, briefly, rather than refused.
CLOSING = frozenset({"CLOSE_WAIT", "FIN_WAIT1", "FIN_WAIT2", "LAST_ACK", "CLOSING"})
SETTLE_SECONDS = 5.0


def _socket_owners(procs: list[psutil.Process]) -> dict[int, tuple[psutil.Process, int]]:
    owner: dict[int, tuple[psutil.Process, int]] = {}
    for p in procs:
        for fd, target in fd_targets(p.pid):
            ino = _socket_inode(target)
            if ino is not None:
                owner[ino] = (p, fd)
    return owner


def outside_connections(root_pid: int) -> list[tuple[TcpSocket, psutil.Process, int]]:
    """TCP connections the tree holds to peers outside it (CRIU cannot restore their other end)."""
    owner = _socket_owners(tree(root_pid))
    sockets = tcp_sockets(root_pid)
    by_endpoints = {(s.local, s.remote): s for s in sockets}
    out = []
    for s in sockets:
        if s.inode not in owner or s.state in ("LISTEN", "CLOSE"):
            continue
        peer = by_endpoints.get((s.remote, s.local))
        if peer is not None and peer.inode in owner:
            continue  # both ends inside the tree: CRIU restores the pair
        out.append((s, *owner[s.inode]))
    return out


def settled_outside_connections(root_pid: int, settle: float = SETTLE_SECONDS) -> list[tuple[TcpSocket, psutil.Process, int]]:
    """outside_connections, after waiting up to *settle* seconds for closing ones to finish closing."""
    deadline = time.monotonic() + settle
    found = outside_connections(root_pid)
    while found and all(s.state in CLOSING for s, _, _ in found) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = outside_connections(root_pid)
    return found


def problems(root_pid: int, *, allowed_device_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Everything in the tree that CRIU cannot capture, each with its fix."""
    procs = tree(root_pid)
    found: list[str] = []
    for p in procs:
        for fd, target in fd_targets(p.pid):
            if _socket_inode(target) is not None:
                continue
            if target == "anon_inode:[io_uring]":
                found.append("%s fd %d: an io_uring instance; start the engine with io_uring disabled (kernel.io_uring_disabled=2)" % (_label(p), fd))
            elif target.startswith("/dev/") and not target.startswith(SHARED_MEMORY_DIRS):
                if target in HARMLESS_DEVICES or target.startswith(("/dev/pts/",) + allowed_device_prefixes):
                    continue
                try:
                    is_char = stat.S_ISCHR(os.stat(target).st_mode)
                except OSError:
                    is_char = False
                if is_char:
                    found.append("%s fd %d: device %s that this driver cannot capture" % (_label(p), fd, target))
        for path in mapped_paths(p.pid):
            if path.startswith("/dev/") and not path.startswith(SHARED_MEMORY_DIRS + allowed_device_prefixes) and path not in HARMLESS_DEVICES:
                found.append("%s maps device %s that this driver cannot capture" % (_label(p), path))
    for s, p, fd in settled_outside_connections(root_pid):
        found.append("%s fd %d: TCP connection %s:%d -> %s:%d (%s) to a peer outside the workload; close it before capture" % (_label(p), fd, s.local[0], s.local[1], s.remote[0], s.remote[1], s.state))
    return sorted(set(found))


def established_inside(root_pid: int) -> bool:
    """Does the tree hold TCP connections between its own processes?"""
    owned = {ino for p in tree(root_pid) for _, t in fd_targets(p.pid) if (ino := _socket_inode(t)) is not None}
    return any(s.inode in owned and s.state not in ("LISTEN", "CLOSE") for s in tcp_sockets(root_pid))


def listening_ports(root_pid: int) -> tuple[int, ...]:
    """The TCP ports the tree listens on (its serving port among them)."""
    owned = {ino for p in tree(root_pid) for _, t in fd_targets(p.pid) if (ino := _socket_inode(t)) is not None}
    return tuple(sorted({s.local[1] for s in tcp_sockets(root_pid) if s.inode in owned and s.state == "LISTEN"}))
