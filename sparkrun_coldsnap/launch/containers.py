"""Units run in Docker containers (sparkrun's usual executor), checkpointed through the runtime."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData, RecordedContainer
from sparkrun_coldsnap.documents.request import redact_env
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.process_tree import tree_pids
from sparkrun_coldsnap.launch import checkpoint_leftovers, container_restore, docker, gpu_container, gpu_devices
from sparkrun_coldsnap.launch.base import Launcher, Progress, RunningUnit, hub_offline
from sparkrun_coldsnap.launch.docker import ContainerSpec
from sparkrun_coldsnap.weights import container_mounts

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest, Workload
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.launch.engine_env import EngineEnv


def container_spec(workload: Workload, command: str, env: Mapping[str, str], labels: Mapping[str, str] | None = None) -> ContainerSpec:
    if not workload.launch.image:
        raise CaptureError("the recipe runs in a container but names no image pinned by digest: set container:")
    return ContainerSpec(
        image=workload.launch.image.split("@", 1)[1],
        image_name=workload.launch.image.split("@", 1)[0],
        command=command,
        env=with_image_pythonpath(workload, env),
        volumes=dict(workload.launch.volumes),
        shm_size=workload.launch.shm_size or "32g",
        labels=dict(labels or {}),
        gpus=unit_gpus(workload),
        # A GPU engine reads its native weights through them (weights/container_mounts.py); a
        # restore needs the same mounts, so they are there from the capture on.
        weights_volumes=container_mounts.for_capture() if workload.driver != "cpu" else {},
    )


def with_image_pythonpath(workload: Workload, env: Mapping[str, str]) -> dict[str, str]:
    """*env* with the image's own PYTHONPATH after what the plugin put there.

    An engine adapter puts its extension's directory on the engine's PYTHONPATH; a container's
    ``-e PYTHONPATH=`` replaces what the image sets rather than extending it, and an image that
    keeps its engine's packages on PYTHONPATH would start an engine that cannot import itself.
    A recipe that sets PYTHONPATH decides alone, as docker lets it."""
    out = dict(env)
    added = out.get("PYTHONPATH")
    if added and "PYTHONPATH" not in workload.launch.env and workload.launch.image:
        image_path = docker.image_env(workload.launch.image.split("@", 1)[-1]).get("PYTHONPATH")
        if image_path and image_path not in added.split(os.pathsep):
            out["PYTHONPATH"] = os.pathsep.join((added, image_path))
    return out


def unit_gpus(workload: Workload) -> tuple[str, ...]:
    """The unit's accelerators, as sparkrun's --gpus gives them; a solo unit (no device list) the
    host's GPUs, unless its snapshot driver is the CPU one."""
    unit = workload.topology.units[0]
    if unit.devices or workload.driver == "cpu":
        return tuple(unit.devices)
    return gpu_devices.host_gpus(settings.current().cuda_visible_devices)


@dataclass
class StagedContainer:
    """A new container created and loaded with the checkpoint under a temporary name, not started."""

    driver: SnapshotDriver
    container: Any
    details: dict[str, Any] = field(default_factory=dict)

    def activate(self, name: str, *, log_path: Path, progress: Progress) -> RunningUnit:
        container, self.container = self.container, None
        if isinstance(container, gpu_container.PreparedGpuContainer):
            running = gpu_container.start(container, name, progress)
        else:
            progress("docker start --checkpoint")
            running = container_restore.start_from_checkpoint(container, name)
        tiles = getattr(running, "amx_permission", None)
        if tiles is not None:
            self.details["amx_permission"] = tiles
        filled = getattr(running, "page_fill", None)
        if filled is not None:
            self.details["page_fill"] = filled
        return running

    def discard(self) -> None:
        if self.container is not None:
            self.container.remove()
            self.container = None


class Containers(Launcher):
    executor = "docker"
    stage_phase = "prepare.container"
    summary = "Docker containers: captured with docker checkpoint, restored into a new container under sparkrun's name"

    def engine_env(self, workload: Workload, engine_env: EngineEnv | None, base_env: Mapping[str, str]) -> dict[str, str]:
        return hub_offline(workload, workload.launch.env)  # a container gets only the workload's

    def check_capturable(self) -> None:
        docker.check_checkpointing()

    def runtime_summary(self) -> str | None:
        return docker.runtime_summary()

    def start(self, workload: Workload, command: str, env: Mapping[str, str], *, log_path: Path, name: str, labels: Mapping[str, str] | None = None) -> RunningUnit:
        return docker.start_container(container_spec(workload, command, env, labels), name)

    def room_needed(self, images: Path) -> list[tuple[Path, float, str]]:
        # docker checkpoint create: runc dumps into containerd's temporary directory, containerd
        # tars that into its content store (under docker's root), and dockerd unpacks the blob
        # into the container's checkpoint folder while the blob still exists.
        temp = sorted(checkpoint_leftovers.containerd_temp_dirs()) or [Path("/tmp")]
        return super().room_needed(images) + [
            (Path(docker.info()["root_dir"]), 2.0, "docker's checkpoint (containerd's content store and docker's checkpoint folder)"),
            (temp[0], 1.0, "containerd's temporary copy of the checkpoint"),
        ]

    def checkpoint(self, driver: SnapshotDriver, unit: RunningUnit, images: Path, *, unit_def: LaunchUnit, progress: Progress) -> UnitImage:
        """docker's checkpoint of the container (its runc runs CRIU), between the driver's device
        steps where it has device state; the container stops."""
        if not driver.in_containers:
            raise CaptureError("snapshot driver %s does not capture containers; use executor: local, or the cpu driver" % driver.name)
        assert isinstance(unit, docker.ContainerUnit), "a container unit of another launcher"
        root = unit.root_pid
        pids = tuple(tree_pids(root))
        if driver.device_state:
            data = gpu_container.capture(driver, unit, images, pids=pids, progress=progress)
        else:
            progress("docker checkpoint of %d processes" % len(pids))
            docker.checkpoint(unit, images)
            data = DriverData()
        size = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
        spec = unit.spec
        assert spec is not None, "a container the plugin did not start"
        recorded = RecordedContainer.model_validate(dict(spec.to_json(), env=redact_env(dict(spec.env))))
        data = data.merged(DriverData(container=recorded, runtime=docker.runtime_summary()))
        return UnitImage(
            name=unit_def.name, host=unit_def.host, driver=driver.name, root_pid=root, pids=pids, pid_namespace=True, image_bytes=size,
            criu_version=driver.checkpoint_tool_version(), driver_data=data,
        )  # fmt: skip

    def stage(self, driver: SnapshotDriver, image: UnitImage, images: Path, *, staging: Path, request: RestoreRequest) -> StagedContainer:
        launch = request.workload.launch
        recorded = image.driver_data.container
        if recorded is None:
            raise RestoreError("unit %s of capsule %s records no container (it was captured with executor local): restore it with executor local" % (image.name, request.capsule.name))
        spec = ContainerSpec.from_json(recorded.model_dump(), labels=request.workload_labels, env=launch.env, volumes=launch.volumes)
        temp = "coldsnap-restore-%s-%s" % (request.capsule.name, os.path.basename(staging)[-8:].lower())
        try:
            staged = StagedContainer(driver, self._prepare(driver, image, images, spec, temp))
        finally:
            paths.remove_staging(staging)  # the container holds its own copy now
        prepared = staged.container.unit if isinstance(staged.container, gpu_container.PreparedGpuContainer) else staged.container
        split = getattr(prepared, "fill_split", None)
        if split is not None:
            staged.details["staged_images"] = {"page_fill_split": split}
        return staged

    def _prepare(self, driver: SnapshotDriver, image: UnitImage, images: Path, spec: ContainerSpec, temp: str) -> Any:
        """The container a restore will start, loaded with *images* (before eviction)."""
        if not driver.in_containers:
            raise RestoreError("snapshot driver %s does not restore containers" % driver.name)
        if driver.device_state:
            return gpu_container.prepare(driver, image, images, spec, temp)
        return container_restore.prepare_restore(spec, images, temp, lazy=driver.memory_on_demand())
