"""The ``n580`` driver: a pre-CUDA process template.

Where the process checkpoint API is refused (DGX Spark's GB10 with driver
580 answers CUDA_ERROR_NOT_SUPPORTED), the engine is captured earlier: after
its imports and configuration, before it touches CUDA. After restore it goes
on from there: initializes CUDA, loads weights and builds its graphs. It saves
the import and set-up time; the compile and JIT caches its engine filled at
capture travel in the capsule (capsule/engine_caches.py), so a restore on a node
that never ran the engine does not compile again. CUDA initialization, the
weights and the CUDA graphs stay the GPU's work after every restore.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu import tree_inspect
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.cuda.nvidia import driver_major
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.base import Progress, RestoredUnit, Support
from sparkrun_coldsnap.drivers.criu_driver import CriuDriver
from sparkrun_coldsnap.errors import CaptureError, EngineError, RequestError, ToolError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.host import gpu_platform
from sparkrun_coldsnap.host.facts import HostFacts

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.settings import Settings
    from sparkrun_coldsnap.engines.base import EngineAdapter
    from sparkrun_coldsnap.launch.base import RunningUnit

LAUNCHER = Path(__file__).with_name("template_launcher.py")
READY = "coldsnap-template: ready"
MIN_DRIVER = gpu_platform.TEMPLATE_MIN_BRANCH


def template_command(command: str, *, module_for_script: dict[str, str], preload: tuple[str, ...]) -> str:
    """Rewrite ``python -m MODULE ARGS`` (or a known console script) to start through the launcher."""
    argv = shlex.split(command)
    if "-m" in argv:
        i = argv.index("-m")
        module, python, rest = argv[i + 1], argv[:i], argv[i + 2 :]
    elif argv and os.path.basename(argv[0]) in module_for_script:
        module, python, rest = module_for_script[os.path.basename(argv[0])], ["python"], argv[1:]
    else:
        raise RequestError("the n580 driver starts engines as `python -m MODULE`; cannot place its boundary in: %s" % command)
    return shlex.join([*python, str(LAUNCHER), module, ",".join(preload), "--", *rest])


def wait_for_boundary(log_path: Path, alive, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if READY in log_path.read_text(errors="replace"):
                return time.monotonic() - t0
        except OSError:
            pass
        if not alive():
            raise EngineError("the engine exited before reaching the pre-CUDA boundary; see %s" % log_path)
        time.sleep(0.05)
    raise EngineError("the engine did not reach the pre-CUDA boundary within %.0f s; see %s" % (timeout, log_path))


class N580Driver(CriuDriver):
    name = "n580"
    preference = 20
    summary = "pre-CUDA process template: captured after imports, initializes CUDA and loads weights after restore"
    weights_in_image = False
    boundary = "template"
    engine_loads_weights = True
    carries_engine_caches = True

    def launch_command(self, command: str, adapter: EngineAdapter, settings: Settings) -> str:
        return template_command(command, module_for_script=adapter.console_scripts, preload=settings.template_preload or adapter.template_preload)

    def await_boundary(self, unit: RunningUnit, log_path: Path, timeout: float) -> None:
        wait_for_boundary(log_path, unit.alive, timeout)

    def support(self, host: HostFacts) -> Support:
        if not host.gpu.gpus:
            return Support(False, "no NVIDIA GPU on this host")
        major = driver_major(host.gpu.nvidia_driver)
        if major is None or major < MIN_DRIVER:
            return Support(False, "NVIDIA driver %s is older than %d" % (host.gpu.nvidia_driver, MIN_DRIVER))
        try:
            criu = Criu.locate()
        except ToolError as err:
            return Support(False, str(err))
        return Support(True, "driver %s; criu %s" % (host.gpu.nvidia_driver, criu.version))

    def precheck(self, root_pid: int) -> list[str]:
        problems = tree_inspect.problems(root_pid)
        return [p + " (the engine touched the GPU before the template boundary)" if "/dev/nvidia" in p else p for p in problems]

    def checkpoint(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress) -> UnitImage:
        # The template keeps running after the dump: capture then lets it go on
        # to serve once, to record the reply restores are validated against.
        return criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, progress=progress, leave_running=True)

    def after_checkpoint(self, root_pid: int) -> None:
        try:
            os.kill(root_pid, signal.SIGUSR1)
        except ProcessLookupError as err:
            raise CaptureError("the template process %d is gone" % root_pid) from err

    def admission(self, unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
        return criu_tree.restore_problems(unit, replacing=replacing)

    def restore(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None, warm: Any = None, port: int | None = None) -> RestoredUnit:
        pid, handed = criu_tree.restore(Criu.locate(), unit, images, log_path=log_path, progress=progress, lazy=False)
        self.after_checkpoint(pid)
        return RestoredUnit(pid, handed)

    def capabilities(self, host: HostFacts) -> dict:
        out = super().capabilities(host)
        out["qualification"] = {
            "qualified": "vLLM 0.26.0 on an NVIDIA H200, x86_64, driver 580.159.04 (docs/benchmarks.md); the boundary is after torch and transformers: importing vLLM itself opened the GPU",
            "aarch64": "the intended use (DGX Spark, driver 580); not run here",
        }
        return out


@hookimpl
def register_drivers(register) -> None:
    register(N580Driver())
