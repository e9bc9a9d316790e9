"""The interface each rank's collectives bind to, across hosts: the one holding the address
sparkrun placed the rank at, found on its host (host/socket_iface.py says why).

gloo binds to ``GLOO_SOCKET_IFNAME`` (vLLM's CPU group on every platform, and the CPU
build's tensor parallel); NCCL's socket transport, which a driver of several GPU ranks sets
across hosts (``NCCL_NET=Socket``: cuda/ranks.py), binds to ``NCCL_SOCKET_IFNAME``. Left
unset, gloo takes the address the host's name resolves to and a rank on another host dies
at start. A launch that names them already (the recipe's env, sparkrun's detection on hosts
with InfiniBand) keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparkrun_coldsnap.controller.cut import on_every_unit
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.units.steps import SocketInterfaceStep

GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"

Launches = Mapping[str, tuple[str, dict[str, str]]]


def wanted(env: Mapping[str, str]) -> list[str]:
    """The interface variables a rank launched with *env* binds its collectives by and lacks."""
    names = [GLOO, *([NCCL] if env.get("NCCL_NET") == "Socket" else [])]
    return [n for n in names if n not in env]


def pinned(units: Sequence[LaunchUnit], hosts: UnitHosts, launches: Launches, rb: ReceiptBuilder) -> dict[str, tuple[str, dict[str, str]]]:
    """Each unit's (command, environment) with its collectives bound to the interface holding
    its placed address on its host. A host where no interface holds it is refused before any
    engine starts, naming the setting. One unit (ranks on loopback, or one process) is left as it is."""
    out = {name: (command, dict(env)) for name, (command, env) in launches.items()}
    if len(units) < 2:
        return out
    asking = [u for u in units if wanted(out[u.name][1])]
    found = on_every_unit(asking, lambda u: hosts.call(u, SocketInterfaceStep(address=u.host), timeout=60).interface)
    lost = [u for u in asking if not found[u.name]]
    if lost:
        names = " and ".join(sorted({n for u in lost for n in wanted(out[u.name][1])}))
        raise RequestError(
            "no network interface of %s holds the address sparkrun placed its rank at, so %s cannot be derived: set %s in the recipe's env to the interface the other hosts reach it by"
            % ("; ".join("host %s (unit %s)" % (u.host, u.name) for u in lost), names, names)
        )
    for u in asking:
        env = out[u.name][1]
        for name in wanted(env):
            env[name] = str(found[u.name])
    if asking:
        rb.details["socket_interfaces"] = {u.name: found[u.name] for u in asking}
    return out
