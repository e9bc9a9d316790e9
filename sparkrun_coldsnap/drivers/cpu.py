"""The ``cpu`` driver: CRIU alone, for engines that run without a GPU.

The engine cannot release its weights on the CPU (vLLM has no sleep mode
there), so they travel inside the process images: the capsule says so.

The engine is captured where it ran, in the host's namespaces, and comes
back in PID, mount and network namespaces of its own
(:mod:`sparkrun_coldsnap.criu.isolated`): its captured PIDs and
``/dev/shm`` names never meet the host's, so a restore can be staged while
the workload it replaces still serves, and one capsule can be restored twice
on one host, each on its own port. (The GPU drivers restore into the host's
namespaces: CUDA failed to initialize inside a PID namespace on the GPU
machine.)
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.criu import isolated as criu_isolated
from sparkrun_coldsnap.criu import nested as criu_nested
from sparkrun_coldsnap.criu import page_fill, tree_inspect
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.base import Progress, RestoredUnit, Support
from sparkrun_coldsnap.drivers.criu_driver import CriuDriver
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.host.facts import HostFacts


class CpuDriver(CriuDriver):
    name = "cpu"
    preference = 90  # after the GPU drivers: a GPU host should not pick it by default
    summary = "CRIU process-tree capture for CPU engines; weights inside the process images"
    weights_in_image = True
    own_namespaces = True
    across_hosts = True
    in_containers = True

    def support(self, host: HostFacts) -> Support:
        if platform.system() != "Linux":
            return Support(False, "CRIU needs Linux")
        try:
            criu = Criu.locate()
        except ToolError as err:
            return Support(False, str(err))
        if host.gpu.gpus:
            return Support(True, "criu %s (%s); GPUs present: only CPU engines can use this driver" % (criu.version, criu.source))
        return Support(True, "criu %s (%s)" % (criu.version, criu.source))

    def precheck(self, root_pid: int) -> list[str]:
        return tree_inspect.problems(root_pid)

    def checkpoint(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress) -> UnitImage:
        init = criu_nested.namespace_init(root_pid)
        if init is not None:  # a restored tree, hibernated: dumped from inside its namespaces
            return criu_nested.dump(Criu.locate(), root_pid, init, images, unit=unit, host=host, driver=self.name, progress=progress)
        return criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, progress=progress)

    def admission(self, unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
        # Restored in namespaces of its own, the tree needs none of the host's PIDs,
        # shared-memory names or ports: nothing on the host can be in its way.
        return []

    def stage_images(self, unit: UnitImage, images: Path) -> dict[str, Any] | None:
        # The big areas written by several threads after criu restore beat memory on demand
        # too: the tiny vLLM answered 0.94 s after the restore began, against 1.74 s with its
        # pages delivered as it faulted on them (its first request touches most of them, one
        # round trip to the lazy-pages daemon each). COLDSNAP_PAGE_FILL=0 gives memory on
        # demand back where the host has it.
        if not settings.current().page_fill_threads:
            return None
        return {"page_fill_split": page_fill.split_for_fill(images).to_json()}

    def restore(
        self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None, warm: Any = None, port: int | None = None,
    ) -> RestoredUnit:  # fmt: skip
        measured: dict[str, Any] = {}
        root, _keeper, handed = criu_isolated.restore(Criu.locate(), unit, images, log_path=log_path, progress=progress, host_port=port, owned_dir=owned_dir, details=measured)
        return RestoredUnit(root, images_handed_over=handed, details=measured)


@hookimpl
def register_drivers(register) -> None:
    register(CpuDriver())
