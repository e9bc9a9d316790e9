"""Whether this host can hold back the packets of a rank's connections to other hosts.

A unit of a workload on several hosts is dumped and restored with CRIU's network lock
(``--network-lock iptables``: CRIU runs ``iptables-restore``), and a restore across hosts
holds each connection with one iptables rule until every host has restored its end
(host/peer_lock.py). Without iptables the dump fails after the engine started ("Iptables
configuration failed"): a capture or restore across hosts asks first.
"""

from __future__ import annotations

import shutil

#: the commands CRIU's network lock and the peer lock run
TOOLS = ("iptables", "iptables-restore")
#: the Debian package that brings them
PACKAGE = "iptables"
FIX = "sparkrun coldsnap setup --iptables"


def missing() -> list[str]:
    """The commands of :data:`TOOLS` not on this host's PATH."""
    return [t for t in TOOLS if shutil.which(t) is None]


def problems(operation: str) -> list[str]:
    """What keeps *operation* (one across hosts) from running here, one line each: none when iptables is here."""
    lacking = missing()
    if not lacking:
        return []
    return ["this host lacks %s, which %s runs (CRIU's network lock holds each connection to another host with it): run `%s` here" % (", ".join(lacking), operation, FIX)]
