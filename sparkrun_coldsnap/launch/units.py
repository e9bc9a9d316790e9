"""The one place that maps a workload's executor to its launcher."""

from __future__ import annotations

from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.launch.base import Launcher
from sparkrun_coldsnap.launch.containers import Containers
from sparkrun_coldsnap.launch.host_processes import HostProcesses

LAUNCHERS: dict[str, Launcher] = {launcher.executor: launcher for launcher in (HostProcesses(), Containers())}


def launcher_for(executor: str) -> Launcher:
    try:
        return LAUNCHERS[executor]
    except KeyError:
        raise RequestError("no launcher runs executor %r: use one of %s" % (executor, ", ".join(sorted(LAUNCHERS)))) from None
