"""What a snapshot driver does: check support, capture a unit's process tree, restore it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from sparkrun_coldsnap.host.facts import HostFacts

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import Topology
    from sparkrun_coldsnap.documents.settings import Settings
    from sparkrun_coldsnap.engines.base import EngineAdapter
    from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.progress import Report

Progress = Report


@dataclass(frozen=True)
class RestoredUnit:
    root_pid: int
    #: the driver took over the staging directory (it still reads the images).
    images_handed_over: bool = False
    #: what the restore measured, for the receipt (e.g. the memory fill's timings)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str


class SnapshotDriver(ABC):
    name: ClassVar[str]
    #: lower sorts first when ``driver: auto`` picks.
    preference: ClassVar[int] = 100
    summary: ClassVar[str] = ""
    #: where weights are after capture: inside the process images, or outside.
    weights_in_image: ClassVar[bool] = False
    #: the engine must release device memory before capture.
    needs_release: ClassVar[bool] = False
    #: "serving": capture the validated, serving engine; "template": capture it at a
    #: boundary before it touches the accelerator (``await_boundary``), and let it go on
    #: (``after_checkpoint``) to serve once.
    boundary: ClassVar[str] = "serving"
    #: after a restore the engine loads its weights itself (a template); otherwise they
    #: are in the images or hydrated by the engine adapter.
    engine_loads_weights: ClassVar[bool] = False
    #: the capture points the engine's compile and JIT caches into a directory of the capsule's
    #: and carries what the engine left there as a layer; a restore puts it back before the
    #: engine goes on (a template, whose engine compiles after its boundary: capsule/engine_caches.py).
    carries_engine_caches: ClassVar[bool] = False
    #: a host-process unit comes back in PID, mount and network namespaces of its own: its
    #: captured PIDs, shared-memory names and port need not be free on the host, and the
    #: recipe's port may differ from the captured one (it is forwarded).
    own_namespaces: ClassVar[bool] = False
    #: a workload placed on several hosts can be captured and restored with this driver: each
    #: unit's steps run on its own host (``units/agent.py``) around one cut across
    #: every host (``controller/cut.py``).
    across_hosts: ClassVar[bool] = False
    #: besides the process images, the unit has device state that the driver's own calls move
    #: to host memory and back (n610: the CUDA checkpoint API). A cut across hosts then locks
    #: every unit's devices, checkpoints them all, and only then dumps any unit.
    device_state: ClassVar[bool] = False
    #: a unit in a Docker container can be captured and restored with this driver: the
    #: container launcher runs the runtime's checkpoint between the driver's device steps.
    in_containers: ClassVar[bool] = False

    @property
    def checkpoints_serving(self) -> bool:
        """The engine is validated and quiesced before the checkpoint (not a template)."""
        return self.boundary == "serving"

    def engine_problem(self, adapter: EngineAdapter) -> str | None:
        """Why this driver cannot capture *adapter*'s engine at all (None: it can).

        A driver that keeps the weights in the process images captures an engine running on
        the CPU; an engine with no CPU build never runs there.
        """
        if self.weights_in_image and not adapter.cpu_weight_paths:
            return "%s has no CPU build, and the %s driver captures engines running on the CPU: use a GPU driver (n610 or n580) on a GPU host" % (
                adapter.name, self.name)  # fmt: skip
        return None

    def launch_command(self, command: str, adapter: EngineAdapter, settings: Settings) -> str:
        """The engine command to start for capture (a template driver places its boundary here)."""
        return command

    def launch_settings(self, command: str, env: Mapping[str, str], *, adapter: EngineAdapter, topology: Topology) -> tuple[str, dict[str, str]]:
        """The command and environment the unit needs so this driver can capture it (a unit
        of several GPU ranks: collectives the checkpoint can carry). Unchanged by default."""
        return command, dict(env)

    def device_memory(self, pids: Iterable[int]) -> int:
        """Bytes of device memory *pids* hold that this driver's checkpoint moves into their host
        memory before the dump (so the dump writes them too)."""
        return 0

    def rebuilds_communicators(self, adapter: EngineAdapter, topology: Topology) -> bool:
        """Whether the engine's NCCL communicators must be destroyed before this driver's
        checkpoint and made again after its restore (the controller asks the engine to)."""
        return False

    def await_boundary(self, unit: RunningUnit, log_path: Path, timeout: float) -> None:
        """Wait until a freshly launched engine reaches the point this driver captures at.

        Serving drivers capture after validation, which the controller drives: they return at once.
        """

    def after_checkpoint(self, root_pid: int) -> None:
        """Let the captured tree go on after a checkpoint that left it running (templates)."""

    def compact_images(self, images: Path) -> dict[str, Any] | None:
        """Make a finished dump in *images* smaller without changing what it restores (before
        it is packed); returns what it did for the receipt, None when it has nothing to do."""
        return None

    def stage_images(self, unit: UnitImage, images: Path) -> dict[str, Any] | None:
        """Rework *unit*'s staged *images* for a faster restore, during preparation (off the
        restore clock, the old workload still serving), without changing what they restore;
        returns what it did for the receipt, None when it has nothing to do."""
        return None

    def checkpoint_tool_version(self) -> str | None:
        """The version of the checkpoint tool a capsule's images depend on (recorded, compared)."""
        return None

    @abstractmethod
    def support(self, host: HostFacts) -> Support:
        """Can this driver capture and restore on *host*?"""

    @abstractmethod
    def precheck(self, root_pid: int) -> list[str]:
        """Everything in the running tree that cannot be captured (empty: go ahead)."""

    @abstractmethod
    def checkpoint(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress) -> UnitImage:
        """Capture the tree rooted at *root_pid* into *images*; the tree is gone afterwards."""

    @abstractmethod
    def admission(self, unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
        """Host-side problems that would make restoring *unit* fail (PIDs, files in use).

        *replacing* is the PIDs of the workload the restore replaces: what they hold is freed
        when sparkrun stops that workload, after staging and before the restore, so it is no
        problem."""

    def program_files(self, units: Sequence[UnitImage] = ()) -> tuple[Path, ...]:
        """Files of the programs a restore of *units* runs (not the trees' own): preparation
        reads them into the page cache with the trees' files, before the weights' copy."""
        return ()

    def ready_tools(self) -> dict[str, Any] | None:
        """Make the restore's own tools ready to run without first probing the host, off the
        clock and before preparation's large reads start; what was found or done (receipt),
        None where there is nothing to do. Never raises."""
        return None

    def warm_up(self, unit: UnitImage) -> Any:
        """Start, during preparation, what a restore of *unit* will need and that does not
        touch the running workload (the n610 driver's CUDA helper); handed to ``restore``
        as *warm*, and closed with ``close()`` if the restore never happens."""
        return None

    @abstractmethod
    def restore(
        self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None, warm: Any = None, port: int | None = None,
    ) -> RestoredUnit:  # fmt: skip
        """Restore *unit* from *images*.

        *port* is the host port the workload serves on (a driver with ``own_namespaces``
        forwards it to the captured one; None: the captured port, on the host's network).

        *owned_dir* is the staging directory holding *images*; a driver that
        still reads the images after returning (memory restored on demand)
        takes it over and removes it when done, and says so in the result.
        *warm* is what ``warm_up`` returned; the restore owns it from then on.
        """

    def dump_at_cut(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress, leave_running: bool = False) -> UnitImage:
        """Dump the stopped tree at *root_pid* into *images* at a cut across hosts
        (``across_hosts``), its connections to the other hosts' units included; the tree is
        gone afterwards unless *leave_running*."""
        from sparkrun_coldsnap.errors import CaptureError

        raise CaptureError("snapshot driver %s does not dump a unit at a cut across hosts: use a driver that captures across hosts (cpu, n610)" % self.name)

    def restore_at_cut(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, zombie_wait: float = 30.0, details: dict[str, Any] | None = None) -> int:
        """Restore *unit* from *images* on its host, its processes left stopped as they were at
        the cut across hosts (the coordinator continues every unit together), its output to
        *log_path*; the restored root's PID. What it measured goes into *details*."""
        from sparkrun_coldsnap.errors import RestoreError

        raise RestoreError("snapshot driver %s does not restore a unit at a cut across hosts: use a driver that captures across hosts (cpu, n610)" % self.name)

    # -- a unit's device state, step by step (a cut across hosts; ``device_state``) ----
    # Each step runs on the unit's own host. The coordinator calls a step on every unit before
    # it calls the next step on any, so no device is checkpointed while a peer still computes.

    def lock_devices(self, root_pid: int) -> DriverData:
        """Lock every device user of the tree at *root_pid* (work in flight completes, new work
        waits); what a restore needs of them (the unit's ``driver_data``). On failure the ones
        locked are let go again before the error goes on."""
        return DriverData()

    def checkpoint_devices(self, data: DriverData) -> None:
        """Move the locked device state of *data*'s processes into host memory; on failure every
        one of them is put back to running before the error goes on."""

    def resume_devices(self, data: DriverData, *, state: str) -> list[str]:
        """Put *data*'s processes back to running after a cut that failed. *state* is what the
        coordinator knows of them: ``locked``, ``checkpointed``, or ``unknown`` (a step that
        failed or did not answer: each process is then settled by what the driver reports).
        The problems, one per process that could not be put back."""
        return []

    def restore_devices(self, data: DriverData, *, visible: str | None = None) -> None:
        """Give *data*'s processes (restored by CRIU, running again) their devices back, still
        locked; *visible* picks this host's devices as ``CUDA_VISIBLE_DEVICES`` does (None: the
        plugin's own setting)."""

    def unlock_devices(self, data: DriverData) -> None:
        """Let *data*'s processes use their devices again (after every unit's restore)."""

    # -- what a launcher that dumps the tree with its own tool asks (a container runtime's CRIU;
    # launch/containers.py) -------------------------------------------------------------------

    def device_api(self) -> Any:
        """A handle on the device checkpoint API, for the device steps a launcher runs around
        its own dump (n610: a CUDA helper process, which the caller closes); None without
        ``device_state``."""
        return None

    def memory_on_demand(self) -> bool | None:
        """Whether a restore brings memory back on demand (CRIU's lazy pages) where the host
        can: True or False as this driver wants it, None whenever the host can."""
        return None

    def capabilities(self, host: HostFacts) -> dict[str, Any]:
        s = self.support(host)
        return {
            "name": self.name,
            "summary": self.summary,
            "weights": "in-image" if self.weights_in_image else "external",
            "available_here": s.ok,
            "reason": s.reason,
            "across_hosts": self.across_hosts,
        }
