"""What a snapshot driver recorded about one captured unit: its record in the capsule config."""

from __future__ import annotations

from pydantic import Field

from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.host.file_drift import RecordedFile


class SharedFile(Strict):
    """A file on a shared-memory filesystem the tree uses; CRIU does not save its content."""

    path: str = Field(description="Absolute path the workload used, e.g. /dev/shm/psm_1a2b.")
    size: int
    mode: int
    stored: str = Field(description="Where its content sits inside the unit's image directory.")


class UnitImage(Strict):
    """What a driver recorded about one captured unit; goes into the capsule config."""

    name: str
    host: str
    driver: str
    root_pid: int = Field(description="Host PID of the tree's root at capture.")
    pids: tuple[int, ...] = Field(description="Host PIDs of every process of the tree at capture.")
    pid_namespace: bool = Field(description="The tree ran in its own PID namespace (restore needs no free host PIDs).")
    log_resource: str | None = Field(None, description="The output file as CRIU names it; a fresh one replaces it at restore.")
    shared_files: tuple[SharedFile, ...] = ()
    tcp_established: bool = False
    listening_ports: tuple[int, ...] = Field((), description="TCP ports the tree listened on at capture (a restore in its own network namespace forwards the recipe's port to the captured one).")
    image_bytes: int = 0
    criu_version: str | None = None
    files: tuple[RecordedFile, ...] = Field((), description="Regular files the tree mapped or held open at capture (host processes), compared by admission before a restore.")
    driver_data: DriverData = Field(
        default_factory=DriverData,
        description=(
            "What the driver needs to restore the unit beside its images: n610, its CUDA processes and GPUs; a unit of a workload on several hosts, its connections "
            "to the other hosts' units and its host's part of the native weight payload; executor docker, its container. A field the driver did not record is left out."
        ),
    )
