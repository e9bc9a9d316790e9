"""What a launch unit is to the controller: started, checkpointed, staged for restore, restored.

A unit is one host's share of a workload. How it runs there (host processes, a
container, a unit on another host) is a :class:`Launcher`; the controller tells its
story against this interface and :func:`sparkrun_coldsnap.launch.units.launcher_for`
picks the implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest, Workload
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.host.file_drift import RecordedFile
    from sparkrun_coldsnap.launch.engine_env import EngineEnv

Progress = Callable[[str], None]

#: what tells the hub client (and transformers) to read only local files
HUB_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def hub_offline(workload: Workload, env: Mapping[str, str]) -> dict[str, str]:
    """*env* with the hub client told to stay offline, where the workload's weights are local.

    Its revision is pinned (the request refuses any other) and its files are on this host, so
    the engine has nothing to fetch; left online, vLLM's start asks the hub about the model
    over and over until each request times out (tens of seconds on a machine without a
    network). A value the environment already sets (the recipe's) is kept."""
    out = dict(env)
    if workload.model.path is not None:
        for name, value in HUB_OFFLINE_ENV.items():
            out.setdefault(name, value)
    return out


class RunningUnit(Protocol):
    """A started or restored unit: the root of its process tree and how to stop it."""

    @property
    def root_pid(self) -> int: ...

    def alive(self) -> bool: ...

    def stop(self, grace: float = 10.0) -> None: ...

    def tail(self) -> str:
        """The last non-empty line of the engine's output."""
        ...

    def reap(self, timeout: float = 10.0) -> None: ...

    def log_location(self) -> str:
        """Where the engine's output is, for messages."""
        ...


class StagedUnit(Protocol):
    """A unit made ready for restore before the old workload is stopped."""

    #: what staging and activation did, for the restore's receipt
    details: dict[str, Any]

    def activate(self, name: str, *, log_path: Path, progress: Progress) -> RunningUnit:
        """Bring the unit back under workload *name*; the staged state is consumed."""
        ...

    def discard(self) -> None:
        """Drop what staging made (an activation that never happens, or after one)."""
        ...


class Launcher(ABC):
    """One way of running a workload's units."""

    #: the workload's ``launch.executor`` this launcher serves.
    executor: ClassVar[str]
    #: the receipt's name for the staging step of a restore.
    stage_phase: ClassVar[str] = "prepare.stage_unit"
    #: what it runs units as, for people (capabilities).
    summary: ClassVar[str] = ""

    @abstractmethod
    def engine_env(self, workload: Workload, engine_env: EngineEnv | None, base_env: Mapping[str, str]) -> dict[str, str]:
        """The environment the engine starts with."""

    def check_capturable(self) -> None:
        """Raise when this host cannot checkpoint units of this kind (before anything starts)."""

    def runtime_summary(self) -> str | None:
        """The runtime a checkpoint depends on, recorded in the fingerprint (None: the host itself)."""
        return None

    @abstractmethod
    def start(self, workload: Workload, command: str, env: Mapping[str, str], *, log_path: Path, name: str, labels: Mapping[str, str] | None = None) -> RunningUnit:
        """Start the engine."""

    def record_files(self, unit: RunningUnit, *, skip: Iterable[str] = ()) -> tuple[RecordedFile, ...]:
        """The host files *unit* depends on, for admission to compare before a restore (none:
        what a unit runs is pinned otherwise, as a container's image digest pins its files)."""
        return ()

    def room_needed(self, images: Path) -> list[tuple[Path, float, str]]:
        """Where a checkpoint writes, with how many times the tree's memory it needs there."""
        return [(images, 2.0, "writing the process images and packing them")]

    @abstractmethod
    def checkpoint(self, driver: SnapshotDriver, unit: RunningUnit, images: Path, *, unit_def: LaunchUnit, progress: Progress) -> UnitImage:
        """Checkpoint *unit* with *driver* into *images*."""

    @abstractmethod
    def stage(self, driver: SnapshotDriver, image: UnitImage, images: Path, *, staging: Path, request: RestoreRequest) -> StagedUnit:
        """Make *image* (unpacked at *images*, inside *staging*) ready to restore; *staging* is the stage's now."""
