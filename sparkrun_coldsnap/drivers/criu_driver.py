"""What the bundled drivers share: CRIU captures their process trees."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.criu import image_contents, zero_pages
from sparkrun_coldsnap.criu import kdat as criu_kdat
from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.base import Progress, SnapshotDriver
from sparkrun_coldsnap.errors import RestoreError


class CriuDriver(SnapshotDriver):
    """A driver whose images CRIU writes and reads: the CRIU version is part of the fingerprint."""

    def checkpoint_tool_version(self) -> str | None:
        return Criu.locate().version

    def program_files(self, units: Sequence[UnitImage] = ()) -> tuple[Path, ...]:
        return criu_tool.program_files()

    def ready_tools(self) -> dict[str, Any] | None:
        # Without its record of the kernel's features CRIU probes the kernel on every run,
        # running iptables among others: beside the weights' reads those wait for the disk.
        return criu_kdat.ensure(Criu.locate())

    def compact_images(self, images: Path) -> dict[str, Any] | None:
        # Zero pages of private memory come back as zeros without being in the images:
        # on GPUs the host copy of the device memory the engine still held is mostly zeros.
        # What is left, area by area, says where the restore's bytes come from.
        return {**zero_pages.leave_out_zero_pages(images).to_json(), "held": image_contents.held_by_area(images)}

    def dump_at_cut(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress, leave_running: bool = False) -> UnitImage:
        # A capture's dump ends the tree, so CRIU keeps what it needs of files deleted while
        # open (a POSIX semaphore's link_remap in /dev/shm), which a dump that leaves the tree
        # running removes again.
        return criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, progress=progress, leave_running=leave_running, peers=True)

    def restore_at_cut(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, zombie_wait: float = 30.0, details: dict[str, Any] | None = None) -> int:
        # The dumped tree's processes must be gone, not zombies waiting for the host's init.
        held = criu_tree.pid_problems(unit.pids, zombie_wait=zombie_wait)
        if held:
            raise RestoreError("; ".join(held))
        # The tree comes back stopped as it was dumped at the cut, its AMX tile permission given
        # back before the coordinator continues it.
        pid, _ = criu_tree.restore(Criu.locate(), unit, images, log_path=log_path, progress=progress, details=details if details is not None else {})
        return pid
