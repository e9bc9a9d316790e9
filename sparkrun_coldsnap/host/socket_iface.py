"""Which network interface of this host holds the address the other hosts reach it at.

gloo (and NCCL's socket transport) bind a rank to one interface. Left to choose, gloo takes
the address this host's name resolves to, which need not be one the other hosts reach: on
Debian the name resolves to 127.0.1.1, and a host on several networks may resolve it on
another one; rank 1 then dies at start ("WorkerProc initialization failed"). sparkrun places
every rank at an address the other ranks reach (the head's is the master address), so the
interface holding that address, found on the host itself, is the one to bind to.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def _plain(address: str) -> str:
    ip = ipaddress.ip_address(address.split("%")[0])
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _own_addresses() -> dict[str, str]:
    """Every address of this host's interfaces, with the interface holding it."""
    out: dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(_plain(a.address), name)
    return out


def _resolved(name: str) -> list[str]:
    """What *name* resolves to here, loopback left out (Debian maps a host's own name to 127.0.1.1)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    found = [_plain(str(i[4][0])) for i in infos]
    return [a for a in dict.fromkeys(found) if not ipaddress.ip_address(a).is_loopback]


def interface_holding(address: str, *, ssh_connection: str | None = None) -> str | None:
    """The interface of this host holding *address* (an address, or a name the placement used);
    None when no interface here holds it.

    An address is taken as it is. A name is resolved here; where it resolves to no address of
    this host, the address the coordinator's SSH session reached this host at stands in for it
    (*ssh_connection*, ``SSH_CONNECTION``'s value: its third field; sparkrun's own
    management-interface detection falls back the same way)."""
    own = _own_addresses()
    try:
        return own.get(_plain(address))
    except ValueError:
        pass  # a name, not an address
    for candidate in _resolved(address):
        if candidate in own:
            return own[candidate]
    fields = (ssh_connection or "").split()
    if len(fields) < 3:
        return None
    try:
        return own.get(_plain(fields[2]))
    except ValueError:
        return None
