"""The ``n610`` driver: the fully initialized CUDA process.

Before capture the engine releases weights and KV cache (its sleep mode), so
what remains on the device (CUDA context, compiled kernels, captured graphs,
allocator state) is small; the CUDA driver's checkpoint API moves it into host
memory, and CRIU dumps the tree. Restore reverses it, then the engine
hydrates its weights from the model files the capsule recorded.

The tree runs in the host PID namespace (see drivers/cpu.py for why), so
restore needs the captured PIDs free: admission checks and names any process
holding one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.criu import page_fill, tree_inspect
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda import nvidia
from sparkrun_coldsnap.cuda import ranks as gpu_ranks
from sparkrun_coldsnap.cuda import units as cuda_units
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.base import Progress, RestoredUnit, Support
from sparkrun_coldsnap.drivers.criu_driver import CriuDriver
from sparkrun_coldsnap.errors import CaptureError, ToolError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.host.facts import HostFacts
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import Topology
    from sparkrun_coldsnap.engines.base import EngineAdapter


def _lazy_wanted() -> bool:
    """Memory on demand is opt-in for n610 (it was slower on the GPU machine)."""
    return settings.current().n610_lazy_pages


class N610Driver(CriuDriver):
    name = "n610"
    preference = 10
    summary = "initialized CUDA process: CUDA checkpoint API + CRIU, weights released before capture and hydrated after restore"
    weights_in_image = False
    needs_release = True
    across_hosts = True
    device_state = True
    in_containers = True

    def support(self, host: HostFacts) -> Support:
        problem = nvidia.checkpoint_api_problem(host)
        if problem:
            return Support(False, problem)
        try:
            criu = Criu.locate()
        except ToolError as err:
            return Support(False, str(err))
        major = nvidia.driver_major(host.gpu.nvidia_driver) or 0
        ipc = "with CUDA IPC" if major >= nvidia.IPC_MIN else "without CUDA IPC (keep custom all-reduce off)"
        return Support(True, "driver %s, %s; criu %s" % (host.gpu.nvidia_driver, ipc, criu.version))

    def launch_settings(self, command: str, env: Mapping[str, str], *, adapter: EngineAdapter, topology: Topology) -> tuple[str, dict[str, str]]:
        # Several ranks: collectives that share no device memory between processes (cuda/ranks.py).
        return gpu_ranks.launch_settings(command, env, adapter=adapter, topology=topology)

    def device_memory(self, pids: Iterable[int]) -> int:
        # The CUDA checkpoint moves what stays on the GPU (after the engine's sleep) into host memory.
        return nvidia.memory_of(pids)

    def rebuilds_communicators(self, adapter: EngineAdapter, topology: Topology) -> bool:
        return gpu_ranks.rebuilds_communicators(adapter, topology)

    def precheck(self, root_pid: int) -> list[str]:
        # Device files are allowed here: the checkpoint API closes them before the dump.
        return tree_inspect.problems(root_pid, allowed_device_prefixes=("/dev/nvidia",))

    def checkpoint(self, root_pid: int, images: Path, *, unit: str, host: str, progress: Progress) -> UnitImage:
        pids = tuple(tree_pids(root_pid))
        cuda = cuda_checkpoint.cuda_processes(pids)
        if not cuda:
            raise CaptureError("no process of the workload holds a CUDA context: is the engine running on the GPU?")
        api = cuda_checkpoint.HelperProcess()
        try:
            uuids, every = cuda_units.workload_gpus(api, root_pid, pids)
            progress("CUDA checkpoint of %d processes" % len(cuda))
            # Every rank locked, then every one checkpointed, then the dump; any failure puts
            # every one back to running, so the workload stays as it was.
            dump = lambda: criu_tree.dump(Criu.locate(), root_pid, images, unit=unit, host=host, driver=self.name, progress=progress)  # noqa: E731
            image = gpu_ranks.capture(api, cuda, dump)
            helper_files = api.files()
        finally:
            api.close()
        data = DriverData(cuda_pids=tuple(cuda), gpu_uuids=tuple(uuids), host_gpu_uuids=tuple(every), driver_version=api.driver_version, helper_files=tuple(helper_files))
        return image.model_copy(update={"driver_data": data})

    def program_files(self, units: Sequence[UnitImage] = ()) -> tuple[Path, ...]:
        # The CUDA helper starts as preparation ends; on a node with nothing prepared its imports
        # and CUDA's libraries came from a disk busy with the weights' copy (2 s for an 8B
        # vLLM), so the files it loaded at capture are read with CRIU's.
        helper = [Path(f) for u in units for f in u.driver_data.helper_files or ()]
        return (*super().program_files(units), *helper)

    def admission(self, unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
        if _lazy_wanted():
            criu_tree.lazy_pages_supported(Criu.locate())  # probed now, off the restore clock
        return criu_tree.restore_problems(unit, replacing=replacing) + gpu_ranks.gpu_problems(unit)

    def stage_images(self, unit: UnitImage, images: Path) -> dict[str, Any] | None:
        # CRIU writes a process's pages with one thread; the big areas are written after it
        # by several (page_fill.py). Memory on demand delivers pages itself: nothing to split.
        if _lazy_wanted() or not settings.current().page_fill_threads:
            return None
        return {"page_fill_split": page_fill.split_for_fill(images).to_json()}

    def warm_up(self, unit: UnitImage) -> cuda_checkpoint.HelperProcess:
        # The helper's CUDA initialization takes seconds: let it happen before the clock starts.
        # It must not sit on a PID the restore needs (a young host may hand those out).
        for _ in range(8):
            api = cuda_checkpoint.HelperProcess()
            if api.proc.pid not in unit.pids:
                return api
            api.kill()
        raise ToolError("the CUDA checkpoint helper keeps getting a PID the capsule needs: retry the restore")

    def restore(self, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, owned_dir: Path | None = None, warm: Any = None, port: int | None = None) -> RestoredUnit:
        # The helper sees every GPU (the driver checks the captured UUIDs against the caller's);
        # this side's CUDA_VISIBLE_DEVICES picks the GPUs the workload comes back on. Without a
        # warmed one, it starts now and initializes CUDA while CRIU restores the tree.
        api = warm or self.warm_up(unit)
        try:
            criu = Criu.locate()
            # Memory on demand here too when asked: the CUDA restore then faults in the host
            # copy of the device state as it reads it.
            lazy = _lazy_wanted() and criu_tree.lazy_pages_supported(criu)
            measured: dict[str, Any] = {}
            pid, handed = criu_tree.restore(criu, unit, images, log_path=log_path, progress=progress, lazy=lazy, owned_dir=owned_dir, details=measured)
            try:
                here = api.uuids()
                used, every = unit.driver_data.gpus()
                pairs = cuda_checkpoint.gpu_pairs(used, every, here, cuda_checkpoint.visible_uuids(settings.current().cuda_visible_devices, here))
                cuda = unit.driver_data.cuda_pids or ()
                progress("CUDA restore of %d processes%s" % (len(cuda), " onto other GPUs" if pairs else ""))
                gpu_ranks.restore(api, cuda, pairs)
            except BaseException:
                kill_tree(pid, grace=2.0)
                raise
        finally:
            api.close()
        return RestoredUnit(pid, handed, details=measured)

    # -- one unit of a workload on several hosts, step by step on its host (cuda/units.py) ----

    def lock_devices(self, root_pid: int) -> DriverData:
        with _helper() as api:
            return cuda_units.lock(api, root_pid)

    def checkpoint_devices(self, data: DriverData) -> None:
        with _helper() as api:
            cuda_units.checkpoint(api, data)

    def resume_devices(self, data: DriverData, *, state: str) -> list[str]:
        with _helper() as api:
            return cuda_units.resume(api, data, state=state)

    def restore_devices(self, data: DriverData, *, visible: str | None = None) -> None:
        with _helper() as api:
            cuda_units.restore(api, data, visible=visible if visible is not None else settings.current().cuda_visible_devices)

    def unlock_devices(self, data: DriverData) -> None:
        with _helper() as api:
            cuda_units.unlock(api, data)

    # -- the engine in a Docker container (launch/gpu_container.py runs these around docker's checkpoint)

    def device_api(self) -> cuda_checkpoint.HelperProcess:
        return cuda_checkpoint.HelperProcess()

    def memory_on_demand(self) -> bool | None:
        return _lazy_wanted()

    def capabilities(self, host: HostFacts) -> dict[str, Any]:
        out = super().capabilities(host)
        out["qualification"] = {
            "qualified": "vLLM 0.26.0 on NVIDIA H200s, x86_64, driver 580.159.04, CUDA 13.0, one GPU per workload, custom all-reduce off, native and recovery weights; vLLM restored onto the other GPU of two H200s (docs/benchmarks.md)",
            "x86_64_without_cuda_ipc": "driver >= %d" % nvidia.MIN_X86,
            "aarch64": "driver >= %d" % nvidia.MIN_ARM,
            "gb10": "not supported by driver 580 on GB10 (DGX Spark): the API answers CUDA_ERROR_NOT_SUPPORTED (801); a newer driver that supports it is not yet qualified: use n580",
            "cuda_ipc": "needs driver >= %d with processes started under the driver's checkpoint job file; unqualified: no such driver was available" % nvidia.IPC_MIN,
            "several_ranks": "tensor/pipeline parallel > 1 in one unit: ranks launched with NCCL over sockets, no shared device memory; ordering tested against a fake of the API, not run on two GPUs (docs/gpu-ranks.md)",
            "several_hosts": (
                "a workload sparkrun placed on several hosts (one unit per host, NCCL over sockets between them): every unit's CUDA processes locked, then "
                "checkpointed, then every unit dumped at one cut, each step on its own host; tested with real sparkrun, real CRIU and two hosts made of network "
                "namespaces on a CPU machine, against fake CUDA driver bindings, fake GPUs and a fake tensor-parallel engine; not run on two GPU hosts (none was available)"
            ),
        }
        return out


@contextlib.contextmanager
def _helper() -> Iterator[cuda_checkpoint.HelperProcess]:
    api = cuda_checkpoint.HelperProcess()
    try:
        yield api
    finally:
        api.close()


@hookimpl
def register_drivers(register) -> None:
    register(N610Driver())
