"""Units run as host processes: the engine command as its own process tree (sparkrun's local executor)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.host import file_drift, paths
from sparkrun_coldsnap.host.file_drift import RecordedFile
from sparkrun_coldsnap.host.process_tree import tree_pids
from sparkrun_coldsnap.launch.base import Launcher, Progress, RunningUnit, hub_offline
from sparkrun_coldsnap.launch.local import StartedUnit, start_unit

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest, Workload
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.launch.engine_env import EngineEnv


@dataclass
class StagedTree:
    """Images unpacked on this host, and what the driver started ahead (its warm-up)."""

    driver: SnapshotDriver
    image: UnitImage
    images: Path
    staging: Path
    warm: Any = None
    port: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    _handed_over: bool = False

    def activate(self, name: str, *, log_path: Path, progress: Progress) -> RunningUnit:
        warm, self.warm = self.warm, None
        restored = self.driver.restore(self.image, self.images, log_path=log_path, progress=progress, owned_dir=self.staging, warm=warm, port=self.port)
        # A driver still reading the images (memory on demand) removes them itself when done.
        self._handed_over = restored.images_handed_over
        self.details.update(restored.details)
        return StartedUnit(restored.root_pid, None, log_path)

    def discard(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None
        if not self._handed_over:
            paths.remove_staging(self.staging)
            self._handed_over = True


@dataclass
class RestoredTree:
    """A tree restored ahead of its activation (a warm workload): activating it hands over the
    running tree; nothing is restored then, and nothing is discarded if it never is."""

    root_pid: int
    log_path: Path
    on_handover: Callable[[], None] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def activate(self, name: str, *, log_path: Path, progress: Progress) -> RunningUnit:
        if self.on_handover is not None:
            self.on_handover()
        return StartedUnit(self.root_pid, None, self.log_path)

    def discard(self) -> None:
        pass  # the tree stays warm: releasing it is the lifecycle's


class HostProcesses(Launcher):
    executor = "local"
    stage_phase = "prepare.warm_up"
    summary = "host processes: captured where they run, restored into PID, mount and network namespaces of their own"

    def engine_env(self, workload: Workload, engine_env: EngineEnv | None, base_env: Mapping[str, str]) -> dict[str, str]:
        # A host process inherits the plugin's environment, as sparkrun's local executor's would.
        env = hub_offline(workload, {**base_env, **workload.launch.env})
        return engine_env.apply(env) if engine_env else env

    def start(self, workload: Workload, command: str, env: Mapping[str, str], *, log_path: Path, name: str, labels: Mapping[str, str] | None = None) -> RunningUnit:
        return start_unit(command, env=env, log_path=log_path)

    def record_files(self, unit: RunningUnit, *, skip: Iterable[str] = ()) -> tuple[RecordedFile, ...]:
        return file_drift.record(tree_pids(unit.root_pid), skip=skip)

    def checkpoint(self, driver: SnapshotDriver, unit: RunningUnit, images: Path, *, unit_def: LaunchUnit, progress: Progress) -> UnitImage:
        return driver.checkpoint(unit.root_pid, images, unit=unit_def.name, host=unit_def.host, progress=progress)

    def stage(self, driver: SnapshotDriver, image: UnitImage, images: Path, *, staging: Path, request: RestoreRequest) -> StagedTree:
        reworked = driver.stage_images(image, images)
        staged = StagedTree(driver, image, images, staging, warm=driver.warm_up(image), port=request.workload.launch.port)
        if reworked is not None:
            staged.details["staged_images"] = reworked
        return staged
