"""Facts about this host that capture records and admission compares."""

from __future__ import annotations

import functools
import platform
import shutil
from pathlib import Path

from pydantic import Field

from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.host.runner import run

# ISA extensions user-space code selects kernels by (torch, oneDNN, BLAS,
# tokenizers). A process captured where one exists may execute it after
# restore, so the restoring CPU must have every one the capturing CPU had.
_X86_FEATURES = {
    "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
    "movbe", "adx", "aes", "pclmulqdq", "sha_ni", "vaes", "vpclmulqdq", "gfni", "rdrand", "rdseed",
    "xsave", "xsaveopt", "xsavec", "xsaves", "erms", "fsrm", "clflushopt", "clwb",
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi", "avx512vbmi2",
    "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "amx_bf16", "amx_int8", "amx_tile",
}  # fmt: skip
_ARM_FEATURES = {
    "fp", "asimd", "aes", "pmull", "sha1", "sha2", "sha3", "sha512", "crc32", "atomics", "fphp", "asimdhp",
    "asimdrdm", "asimddp", "asimdfhm", "lrcpc", "ilrcpc", "dcpop", "sve", "sve2", "svebf16", "svei8mm",
    "bf16", "i8mm", "sm3", "sm4", "flagm", "paca", "pacg", "sb", "ssbs", "dit", "uscat", "jscvt", "fcma",
}  # fmt: skip


class GpuInfo(Strict):
    name: str
    compute_capability: str
    memory_mib: int | None = None
    uuid: str | None = Field(None, description="Recorded, not compared: another GPU of the same model is allowed.")


def boot_id() -> str:
    """This boot of the kernel: what is kept across reboots but true only for one is marked with it."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def cpu_features(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The kernel-selection-relevant CPU features of this host, sorted."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ()
    wanted = _ARM_FEATURES if platform.machine() in ("aarch64", "arm64") else _X86_FEATURES
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split()) & wanted))
    return ()


#: what gpu_facts asks nvidia-smi, in this order
QUERY_FIELDS = "name,compute_cap,memory.total,uuid,driver_version"


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
        q = run([smi, "--query-gpu=%s" % QUERY_FIELDS, "--format=csv,noheader,nounits"], timeout=30, check=False)
        head = run([smi], timeout=30, check=False)
    except Exception as err:  # noqa: BLE001 - a broken smi is reported, not fatal
        return GpuFacts(problem="nvidia-smi failed: %s" % err)
    if q.returncode != 0:
        return GpuFacts(problem="nvidia-smi failed: %s" % q.tail())
    return parse_gpu_facts(q.stdout, head.stdout)


def parse_gpu_facts(query: str, header: str) -> GpuFacts:
    """GpuFacts from nvidia-smi's answers: *query* to ``--query-gpu=QUERY_FIELDS --format=csv,noheader,nounits``,
    *header* its plain table (for the CUDA version). A field the GPU does not report (``[N/A]``,
    e.g. GB10's memory, which is the host's) is None."""
    gpus, driver = [], None
    for line in query.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        name, cc, mem, uuid, driver = parts[:5]
        gpus.append(GpuInfo(name=name, compute_capability=cc, memory_mib=int(float(mem)) if mem.replace(".", "").isdigit() else None, uuid=uuid))
    return GpuFacts(nvidia_driver=driver, cuda_version=_parse_cuda_version(header), gpus=tuple(gpus))


@functools.lru_cache(maxsize=1)
def host_facts() -> HostFacts:
    return HostFacts(
        cpu_arch=platform.machine(),
        cpu_features=cpu_features(),
        kernel_release=platform.release(),
        gpu=gpu_facts(),
    )
