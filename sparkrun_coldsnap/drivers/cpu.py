"""The ``cpu`` driver: CRIU alone, for engines that run without a GPU.

The engine cannot release its weights on the CPU (vLLM has no sleep mode
there), so they travel inside the process images: the capsule says so. The
tree runs in its own PID namespace, so restore never needs host PIDs free.
"""

from __future__ import annotations

import platform
from pathlib import Path

from sparkrun_coldsnap.drivers import criu_tree, tree_inspect
from sparkrun_coldsnap.drivers.base import Progress, RestoredUnit, SnapshotDriver, Support, UnitImage
from sparkrun_coldsnap.drivers.criu_tool import Criu
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.hostinfo import HostFacts


class CpuDriver(SnapshotDriver):
    name = "cpu"
    preference = 90  # after the GPU drivers: a GPU host should not pick it by default
    summary = "CRIU process-tree capture for CPU engines; weights inside the process images"
    weights_in_image = True
    pid_namespace = True

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
        return criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, pid_namespace=True, progress=progress)

    def admission(self, unit: UnitImage) -> list[str]:
        criu_tree.lazy_pages_supported(Criu.locate())  # probed now, off the restore clock
        return criu_tree.shared_file_problems(unit)

    def restore(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None) -> RestoredUnit:
        criu = Criu.locate()
        # Memory on demand: the tree resumes before its pages are copied, and
        # an engine touches little of its memory to answer (its KV cache and
        # ring buffers are mostly idle), so the first token comes sooner.
        lazy = criu_tree.lazy_pages_supported(criu)
        pid, handed = criu_tree.restore(criu, unit, images, log_path=log_path, progress=progress, lazy=lazy, owned_dir=owned_dir)
        return RestoredUnit(pid, handed)


@hookimpl
def register_drivers(register) -> None:
    register(CpuDriver())
