"""The ``n610`` driver in a Docker container: the CUDA checkpoint API around docker's checkpoint.

Written for hosts with Docker and NVIDIA GPUs; the GPU machines this project is measured
on have no Docker at all (no docker, dockerd, containerd or runc binaries: see
docs/architecture.md), so the ordering below is tested against the project's fake of the
CUDA checkpoint API (tests/test_gpu_container.py), and docker's part is the CPU path's,
which runs for real.

The GPUs and the driver's files
    As entries of the container's spec, not through NVIDIA's hook (gpu_devices.py).

Whose calls
    The CUDA checkpoint calls come from the host, through the same helper process as on
    the host path, addressing the engine's processes by their host PIDs: the API takes a
    PID in the caller's namespace, and a helper inside the container would itself be a
    CUDA process of the tree CRIU dumps.

Capture: (the engine has released its weights and KV cache) lock every CUDA process,
then checkpoint each (device memory moves to host memory, the device files close), then
``docker checkpoint create`` (CRIU dumps the tree); if that fails, every process is
restored and unlocked again, and the container goes on serving. The PIDs recorded are
those inside the container's PID namespace, which CRIU gives back.

Restore: ``docker start --checkpoint`` (runc recreates the devices and the driver's
mounts, CRIU the tree, still checkpointed; with a page fill, the tree's big areas are
written and the tree continued before it returns, as on the host path, before any
CUDA restore), the recorded namespace PIDs mapped to the
new host PIDs, then restore every process before unlocking any; a failure removes the
container. The engine then wakes and hydrates its weights (the controller).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda import nvidia
from sparkrun_coldsnap.cuda import ranks as gpu_ranks
from sparkrun_coldsnap.cuda.checkpoint import CheckpointApi
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.host.process_tree import tree_pids
from sparkrun_coldsnap.launch import container_restore, docker

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.launch.base import Progress


class ContainerRuntime(Protocol):
    """What the GPU path needs from docker (launch/docker.py and container_restore.py)."""

    def checkpoint(self, unit: Any, images: Path) -> None: ...
    def start(self, prepared: Any, name: str) -> Any: ...
    def remove(self, unit: Any) -> None: ...
    def tree(self, unit: Any) -> list[int]: ...


class DockerRuntime:
    """The real ContainerRuntime: docker's checkpoint, and the restore the CPU path uses."""

    def checkpoint(self, unit: Any, images: Path) -> None:
        docker.checkpoint(unit, images)

    def start(self, prepared: Any, name: str) -> Any:
        return container_restore.start_from_checkpoint(prepared, name)

    def remove(self, unit: Any) -> None:
        unit.remove()

    def tree(self, unit: Any) -> list[int]:
        return list(tree_pids(unit.root_pid))


class PreparedGpuContainer:
    """A prepared GPU restore: the container, the warmed CUDA helper, and what the restore maps."""

    def __init__(self, unit: Any, api: Any, cuda_ns_pids: Sequence[int], used: Sequence[str], captured_all: Sequence[str]) -> None:
        self.unit, self.api = unit, api
        self.cuda_ns_pids, self.used, self.captured_all = tuple(cuda_ns_pids), tuple(used), tuple(captured_all)

    def remove(self) -> None:
        """Drop the preparation (an activation that never happens)."""
        self.unit.remove()
        self.api.kill()


def capture(driver: SnapshotDriver, unit: docker.ContainerUnit, images: Path, *, pids: Sequence[int], progress: Progress) -> DriverData:
    """The driver's device steps around docker's checkpoint of *unit* (its tree: *pids*); what
    a restore needs of the devices (the unit's ``driver_data``)."""
    cuda = cuda_checkpoint.cuda_processes(pids)
    api = driver.device_api()
    try:
        every = api.uuids()
        uuids = cuda_checkpoint.workload_gpus(every, nvidia.gpus_of(pids))
        progress("CUDA checkpoint of %d processes, then docker checkpoint" % len(cuda))
        data = checkpoint(api, DockerRuntime(), unit, images, cuda_pids=cuda)
    finally:
        api.close()
    return data.merged(DriverData(gpu_uuids=tuple(uuids), host_gpu_uuids=tuple(every), driver_version=api.driver_version))


def prepare(driver: SnapshotDriver, image: UnitImage, images: Path, spec: docker.ContainerSpec, temp_name: str) -> PreparedGpuContainer:
    """The container a restore will start, loaded with *images*, and the driver's device API
    warmed up beside it (before eviction)."""
    container = container_restore.prepare_restore(spec, images, temp_name, lazy=driver.memory_on_demand())
    try:
        api = driver.warm_up(image)
    except BaseException:
        container.remove()
        raise
    used, every = image.driver_data.gpus()
    return PreparedGpuContainer(container, api, image.driver_data.cuda_ns_pids or (), used, every)


def start(prepared: PreparedGpuContainer, name: str, progress: Progress) -> Any:
    """Start *prepared* from its checkpoint as *name*, its CUDA processes given their GPUs back."""
    try:
        here = prepared.api.uuids()
        pairs = cuda_checkpoint.gpu_pairs(prepared.used, prepared.captured_all, here, cuda_checkpoint.visible_uuids(settings.current().cuda_visible_devices, here))
        progress("docker start --checkpoint, then CUDA restore of %d processes" % len(prepared.cuda_ns_pids))
        return restore(prepared.api, DockerRuntime(), prepared.unit, name, cuda_ns_pids=prepared.cuda_ns_pids, pairs=pairs)
    finally:
        prepared.api.close()


def ns_pid(host_pid: int, proc: Path = Path("/proc")) -> int:
    """The PID *host_pid* has inside its own (innermost) PID namespace."""
    for line in (proc / str(host_pid) / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return host_pid


def host_pids_for(ns_pids: Sequence[int], tree: Sequence[int], ns_of: Callable[[int], int] = ns_pid) -> list[int]:
    """The host PIDs of the container processes recorded by their namespace PIDs *ns_pids*."""
    by_ns = {}
    for pid in tree:
        try:
            by_ns[ns_of(pid)] = pid
        except OSError:
            continue  # gone meanwhile
    missing = [p for p in ns_pids if p not in by_ns]
    if missing:
        raise RestoreError("the restored container has no process with PID %s in its namespace: the checkpoint did not come back whole" % ", ".join(map(str, missing)))
    return [by_ns[p] for p in ns_pids]


def checkpoint(api: CheckpointApi, runtime: ContainerRuntime, unit: Any, images: Path, *, cuda_pids: Sequence[int], ns_of: Callable[[int], int] = ns_pid) -> DriverData:
    """CUDA checkpoint of *cuda_pids* (host PIDs), then docker's checkpoint of *unit*.

    Returns what the restore needs (the CUDA processes by namespace PID). On failure
    the workload is left running.
    """
    if not cuda_pids:
        raise CaptureError("no process of the container holds a CUDA context: is the engine running on the GPU?")
    ns = [ns_of(p) for p in cuda_pids]
    # On failure every process goes back to running: the container goes on serving.
    gpu_ranks.capture(api, cuda_pids, lambda: runtime.checkpoint(unit, images))
    return DriverData(cuda_ns_pids=tuple(ns))


def restore(
    api: CheckpointApi, runtime: ContainerRuntime, prepared: Any, name: str, *, cuda_ns_pids: Sequence[int], pairs: Sequence[tuple[str, str]] = (),
    ns_of: Callable[[int], int] = ns_pid,
) -> Any:  # fmt: skip
    """Start *prepared* from its checkpoint as *name*, then CUDA-restore and unlock its processes."""
    unit = runtime.start(prepared, name)
    try:
        pids = host_pids_for(cuda_ns_pids, runtime.tree(unit), ns_of)
        cuda_checkpoint.restore_all(api, pids, pairs)
    except BaseException:
        runtime.remove(unit)
        raise
    return unit
