"""What a snapshot driver recorded of one unit for its restore: ``UnitImage.driver_data``.

It sits in every capsule config and goes between hosts in the unit steps (the devices'
lock, checkpoint, restore and unlock carry it too). Every field is optional: a driver records
what it needs, and a field it leaves unset is left out of the JSON, so the config of a capsule
captured before a field existed reads and writes back byte for byte.
"""

from __future__ import annotations

from pydantic import Field

from sparkrun_coldsnap.documents.strict import Sparse

#: a TCP connection as (local address, port, peer address, port)
Connection = tuple[str, int, str, int]


class RecordedContainer(Sparse):
    """The container a unit ran in (executor docker), as ``docker create`` needs it again."""

    image: str = Field(description="The image's id (sha256:...).")
    command: str = Field(description="The engine's command line inside the container.")
    env: dict[str, str] = Field(description="The container's environment, secret values redacted (a restore takes the recipe's).")
    volumes: dict[str, str] = Field(description="Host path to container path (a restore takes the recipe's).")
    shm_size: str | None = Field(None, description="docker's --shm-size (unset: 32g).")
    gpus: tuple[str, ...] | None = Field(None, description="GPU indices the container got as entries of its spec (unset: none).")
    image_name: str | None = Field(None, description="The name the recipe gave the image (repo:tag), for people.")
    weights_volumes: dict[str, str] | None = Field(
        None, description="The native weights' directories the container bound, role (engine_side, native, memory) to path in the container; a restore binds this host's at the same paths.",
    )  # fmt: skip


class DriverData(Sparse):
    """What a driver needs to restore one unit, beside the process images."""

    cuda_pids: tuple[int, ...] | None = Field(None, description="n610: host PIDs of the tree's processes that hold a CUDA context.")
    cuda_ns_pids: tuple[int, ...] | None = Field(None, description="n610 in a container: those processes' PIDs inside the container's PID namespace.")
    gpu_uuids: tuple[str, ...] | None = Field(None, description="n610: the GPUs the workload used, in the order its ranks see them.")
    host_gpu_uuids: tuple[str, ...] | None = Field(None, description="n610: every GPU of the capture host, in CUDA's order (a restore maps each onto one here).")
    driver_version: int | None = Field(None, description="n610: the CUDA driver's version at capture, as cuDriverGetVersion gives it (13000: 13.0).")
    helper_files: tuple[str, ...] | None = Field(None, description="n610: the files the CUDA checkpoint helper loaded, read into the page cache before a restore.")
    peer_connections: bool | None = Field(None, description="A unit of a workload on several hosts: it holds TCP connections to other hosts' units.")
    peer_tcp: tuple[Connection, ...] | None = Field(None, description="Those connections as [local address, port, peer address, port]; each host holds their packets back until every unit is restored.")
    native_files: tuple[str, ...] | None = Field(None, description="A unit of a workload on several hosts: the files of the native weight payload its host holds.")
    communicators_detached: bool | None = Field(None, description="n610, several GPU ranks: the engine's workers destroyed their NCCL communicators before the checkpoint; a restore has them made again before the weights wake.")
    container: RecordedContainer | None = Field(None, description="Executor docker: the container the unit ran in.")
    runtime: str | None = Field(None, description="Executor docker: the container runtime at capture (docker's version, storage driver, cgroup version).")
    root_pid: int | None = Field(None, description="Only in a device step after a cut that failed before the unit's lock answered: the tree's root, whose device users its host finds again.")

    def merged(self, other: DriverData) -> DriverData:
        """This record with every field *other* sets taken from *other*."""
        return self.model_copy(update={name: value for name in type(other).model_fields if (value := getattr(other, name)) is not None})

    def gpus(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the GPUs the workload used, every GPU of the capture host): a restore's GPU map.
        A record without the host's list names only the used ones (the map needs no others)."""
        used = self.gpu_uuids or ()
        return used, self.host_gpu_uuids or used
