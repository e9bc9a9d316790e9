"""The ``cpu`` driver: CRIU alone, for engines that run without a GPU.

The engine cannot release its weights on the CPU (vLLM has no sleep mode
there), so they travel inside the process images: the capsule says so.

The tree runs in the host PID namespace, and restore needs the captured PIDs
free (admission checks, and names any process holding one). A PID namespace
of its own would avoid that, but without a /proc of its own the engine reads
the wrong processes' /proc/<pid> files (vLLM reads /proc/<getpid()>/status),
and with one (a new mount namespace) CRIU cannot dump the tree's descriptors
opened on the host's mounts. CUDA also failed to initialize inside a PID
namespace on the GPU machine.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.drivers import criu_tree, tree_inspect
from sparkrun_coldsnap.drivers.base import Progress, RestoredUnit, Support, UnitImage
from sparkrun_coldsnap.drivers.criu_driver import CriuDriver
from sparkrun_coldsnap.drivers.criu_tool import Criu
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.host.facts import HostFacts
from sparkrun_coldsnap.host.process_tree import tree_pids


class CpuDriver(CriuDriver):
    name = "cpu"
    preference = 90  # after the GPU drivers: a GPU host should not pick it by default
    summary = "CRIU process-tree capture for CPU engines; weights inside the process images"
    weights_in_image = True

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
        return criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, progress=progress)

    def admission(self, unit: UnitImage) -> list[str]:
        criu_tree.lazy_pages_supported(Criu.locate())  # probed now, off the restore clock
        return criu_tree.restore_problems(unit)

    def restore(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None, warm: Any = None) -> RestoredUnit:
        criu = Criu.locate()
        # Memory on demand: the tree resumes before its pages are copied, and
        # an engine touches little of its memory to answer (its KV cache and
        # ring buffers are mostly idle), so the first token comes sooner.
        lazy = criu_tree.lazy_pages_supported(criu)
        pid, handed = criu_tree.restore(criu, unit, images, log_path=log_path, progress=progress, lazy=lazy, owned_dir=owned_dir)
        return RestoredUnit(pid, handed)


    def checkpoint_container(self, unit: Any, images: Path, *, unit_name: str, host: str, spec: Any, progress: Progress) -> UnitImage:
        from sparkrun_coldsnap.documents.request import redact_env
        from sparkrun_coldsnap.launch import docker as docker_unit

        root = unit.root_pid
        pids = tuple(tree_pids(root))
        progress("docker checkpoint of %d processes" % len(pids))
        docker_unit.checkpoint(unit, images)
        size = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
        recorded = dict(spec.to_json(), env=redact_env(dict(spec.env)))
        return UnitImage(
            name=unit_name,
            host=host,
            driver=self.name,
            root_pid=root,
            pids=pids,
            pid_namespace=True,
            image_bytes=size,
            criu_version=Criu.locate().version,
            driver_data={"container": recorded, "runtime": docker_unit.runtime_summary()},
        )

    def prepare_container(self, unit: UnitImage, images: Path, spec: Any, temp_name: str) -> Any:
        from sparkrun_coldsnap.launch import container_restore

        return container_restore.prepare_restore(spec, images, temp_name)

    def start_container(self, prepared: Any, name: str, progress: Progress) -> Any:
        from sparkrun_coldsnap.launch import container_restore

        progress("docker start --checkpoint")
        return container_restore.start_from_checkpoint(prepared, name)


@hookimpl
def register_drivers(register) -> None:
    register(CpuDriver())
