"""The task and container docker leaves in containerd when its daemon dies while a container starts.

``docker start --checkpoint`` has containerd create the container's task (its shim runs
runc, which runs CRIU's restore). Where dockerd dies in the middle (a crash, SIGKILL), the
task stays in state CREATED with its shim running: the daemon that comes back forgets the
container (``--rm``: ``docker rm -f`` finds nothing to stop) and cannot delete containerd's
container while the task exists. Neither is listed by ``docker ps -a``; each such fault
would leave one more shim running and one more record in docker's containerd. They are
removed with containerd's own client, by the container's id: the task (its shim then
exits), then the container.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.runner import Completed, run

#: containerd's namespace for docker's containers
NAMESPACE = "moby"
#: where containerd listens: the one dockerd starts, then a containerd of the system's
SOCKETS = (Path("/var/run/docker/containerd/containerd.sock"), Path("/run/containerd/containerd.sock"))


def _ctr(sock: Path, *args: str, timeout: float = 60.0) -> Completed | None:
    ctr = shutil.which("ctr")
    if ctr is None:
        return None
    try:
        return run([ctr, "-a", str(sock), "-n", NAMESPACE, *args], check=False, timeout=timeout, what="ctr")
    except ToolError:  # no answer in time: what is left stays, the caller's error says the rest
        return None


def _listed(sock: Path, kind: str, container_id: str) -> bool:
    out = _ctr(sock, kind, "ls", "-q", timeout=30)
    return out is not None and out.returncode == 0 and container_id in out.stdout.split()


def remove(container_id: str, sockets: Sequence[Path] = SOCKETS) -> list[str]:
    """Delete the containerd task and container of *container_id* that docker left; what was
    removed (``task``, ``container``), none where docker left nothing or ``ctr`` is missing."""
    removed = []
    for sock in sockets:
        if not sock.exists():
            continue
        if _listed(sock, "tasks", container_id):
            out = _ctr(sock, "tasks", "delete", container_id)
            if out is None or out.returncode != 0:  # a task whose processes run: stopped first
                _ctr(sock, "tasks", "kill", "--signal", "SIGKILL", container_id)
                _ctr(sock, "tasks", "delete", container_id)
            if not _listed(sock, "tasks", container_id):
                removed.append("task")
        if _listed(sock, "containers", container_id):
            _ctr(sock, "containers", "delete", container_id)
            if not _listed(sock, "containers", container_id):
                removed.append("container")
    return removed
