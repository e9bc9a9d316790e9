"""Facts about this host that capture records and admission compares."""

from __future__ import annotations

import functools
import platform
import shutil

from sparkrun_coldsnap.compat import GpuInfo, cpu_features
from sparkrun_coldsnap.proc import run
from sparkrun_coldsnap.strict import Strict


class GpuFacts(Strict):
    nvidia_driver: str | None = None
    cuda_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()
    problem: str | None = None


class HostFacts(Strict):
    cpu_arch: str
    cpu_features: tuple[str, ...]
    kernel_release: str
    gpu: GpuFacts


def _parse_cuda_version(header: str) -> str | None:
    for token in header.replace("|", " ").split("CUDA Version:")[1:]:
        return token.split()[0]
    return None


@functools.lru_cache(maxsize=1)
def gpu_facts() -> GpuFacts:
    """NVIDIA driver, CUDA driver API version and GPUs, from nvidia-smi.

    No nvidia-smi means no NVIDIA GPU to capture: an empty answer, not an error.
    """
    smi = shutil.which("nvidia-smi")
    if not smi:
        return GpuFacts()
    try:
        q = run([smi, "--query-gpu=name,compute_cap,memory.total,uuid,driver_version", "--format=csv,noheader,nounits"], timeout=30, check=False)
        head = run([smi], timeout=30, check=False)
    except Exception as err:  # noqa: BLE001 - a broken smi is reported, not fatal
        return GpuFacts(problem="nvidia-smi failed: %s" % err)
    if q.returncode != 0:
        return GpuFacts(problem="nvidia-smi failed: %s" % q.tail())
    gpus, driver = [], None
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        name, cc, mem, uuid, driver = parts[:5]
        gpus.append(GpuInfo(name=name, compute_capability=cc, memory_mib=int(float(mem)) if mem.replace(".", "").isdigit() else None, uuid=uuid))
    return GpuFacts(nvidia_driver=driver, cuda_version=_parse_cuda_version(head.stdout), gpus=tuple(gpus))


@functools.lru_cache(maxsize=1)
def host_facts() -> HostFacts:
    return HostFacts(
        cpu_arch=platform.machine(),
        cpu_features=cpu_features(),
        kernel_release=platform.release(),
        gpu=gpu_facts(),
    )
