"""A rank's connections to other hosts kept silent until every host has restored its end.

CRIU restores a TCP connection in repair mode and, when it turns repair off, the kernel sends
the peer a probe. Were the peer's end not restored yet, the peer's kernel would find no socket
for that probe and answer with a reset, and the restored connection would be dead before its
process runs. CRIU's own network lock only covers this when a dump on the same host left its
rules in place (the first restore after a capture): each host's restore lifts the rules at its
own end, whatever the other hosts have done. A restore that replaces a running workload finds
no rules at all.

So, before any host restores, each host drops the packets arriving for its unit's connections
to the other hosts; once every host has restored, the drops are lifted everywhere. Both ends
then exchange what was held back (retransmission), and no packet ever met a missing socket.
The rules match exactly one connection each and carry nothing of CRIU's own (whose removal at
the end of its restore therefore leaves them alone).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence

import psutil

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.runner import run

Connection = tuple[str, int, str, int]  # local address, port, peer address, port


def _plain(address: str) -> str:
    """An IPv4 address as itself, also where a dual-stack socket shows it mapped into IPv6 (the
    packets, and so the rules that match them, are IPv4)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def to_other_hosts(connections: Iterable[Connection]) -> list[Connection]:
    """The connections whose peer is not on this host (neither a loopback nor one of its own
    addresses): those a restore on another host brings back the other end of."""
    own = {_plain(a.address) for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    plain = {(_plain(lip), lport, _plain(rip), rport) for lip, lport, rip, rport in connections}
    return sorted(c for c in plain if not ipaddress.ip_address(c[2]).is_loopback and c[2] not in own)


def _rule(c: Connection) -> list[str]:
    lip, lport, rip, rport = c
    return ["INPUT", "--protocol", "tcp", "--source", rip, "--sport", str(rport), "--destination", lip, "--dport", str(lport), "-j", "DROP"]


def _tables(c: Connection) -> str:
    return "ip6tables" if ":" in c[0] else "iptables"


def _has(c: Connection) -> bool:
    return run([_tables(c), "-w", "-t", "filter", "-C", *_rule(c)], timeout=30, check=False).returncode == 0


def lock(connections: Sequence[Connection]) -> None:
    """Drop what arrives for each connection (once: a rule already there is not added again).
    A rule that cannot be added lifts those added and raises, naming the connection."""
    added: list[Connection] = []
    for c in connections:
        if _has(c):
            continue
        done = run([_tables(c), "-w", "-t", "filter", "-I", *_rule(c)], timeout=30, check=False)
        if done.returncode != 0:
            unlock(added)
            raise ToolError("cannot hold back the packets of connection %s:%d <- %s:%d (%s): %s" % (c[0], c[1], c[2], c[3], _tables(c), (done.stderr or done.stdout).strip()[-300:]))
        added.append(c)


def unlock(connections: Sequence[Connection]) -> list[str]:
    """Lift the drops of :func:`lock`; the connections whose rule could not be removed, one line each."""
    problems = []
    for c in connections:
        while _has(c):
            done = run([_tables(c), "-w", "-t", "filter", "-D", *_rule(c)], timeout=30, check=False)
            if done.returncode != 0:
                problems.append("%s:%d <- %s:%d: %s" % (c[0], c[1], c[2], c[3], (done.stderr or done.stdout).strip()[-200:]))
                break
    return problems
