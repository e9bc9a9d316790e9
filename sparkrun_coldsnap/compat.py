"""The compatibility fingerprint recorded at capture, and admission before restore.

Restoring a process image onto a host that differs in what the process
depends on (CPU instructions it chose kernels for, kernel, CRIU, driver, GPU,
engine build, model) fails in ways that are slow to diagnose, or worse,
answers wrongly. Admission compares every recorded fact with the host at hand
and names every mismatch at once, before anything is stopped or started.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Callable

from pydantic import Field

from sparkrun_coldsnap.errors import CompatibilityError
from sparkrun_coldsnap.strict import Strict

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


class TopologyFacts(Strict):
    hosts: int
    units: int
    tensor_parallel: int
    pipeline_parallel: int


class Fingerprint(Strict):
    cpu_arch: str
    cpu_features: tuple[str, ...]
    kernel_release: str
    criu_version: str | None
    nvidia_driver: str | None
    cuda_version: str | None
    gpus: tuple[GpuInfo, ...]
    engine: str
    engine_version: str | None
    python_version: str | None
    torch_version: str | None
    image_digest: str | None
    container_runtime: str | None = Field(None, description="Container runtime, its version and the settings a checkpoint depends on.")
    engine_env_digest: str | None
    model_revision: str
    topology: TopologyFacts


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


@dataclass(frozen=True)
class Mismatch:
    field: str
    captured: object
    here: object

    def __str__(self) -> str:
        return "%s: captured %s, here %s" % (self.field, _show(self.captured), _show(self.here))


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return "[%s]" % ", ".join(_show(v) for v in value) if value else "none"
    if isinstance(value, GpuInfo):
        return "%s (sm %s)" % (value.name, value.compute_capability)
    if isinstance(value, TopologyFacts):
        return "%d host(s), %d unit(s), tp %d, pp %d" % (value.hosts, value.units, value.tensor_parallel, value.pipeline_parallel)
    return str(value)


def _same(field: str) -> Callable[[Fingerprint, Fingerprint], list[Mismatch]]:
    def check(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
        a, b = getattr(cap, field), getattr(here, field)
        return [] if a == b else [Mismatch(field, a, b)]

    return check


def _features(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    missing = sorted(set(cap.cpu_features) - set(here.cpu_features))
    return [Mismatch("cpu_features", "has " + ", ".join(missing), "lacks them")] if missing else []


def _gpus(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    # Compare model and capability per GPU, not identity: restoring onto another
    # GPU of the same model is supported through device remapping.
    a = sorted((g.name, g.compute_capability) for g in cap.gpus)
    b = sorted((g.name, g.compute_capability) for g in here.gpus)
    out = []
    if len(a) != len(b):
        out.append(Mismatch("gpu_count", len(a), len(b)))
    elif a != b:
        out.append(Mismatch("gpus", cap.gpus, here.gpus))
    return out


CHECKS: tuple[Callable[[Fingerprint, Fingerprint], list[Mismatch]], ...] = (
    _same("cpu_arch"),
    _features,
    _same("kernel_release"),
    _same("criu_version"),
    _same("nvidia_driver"),
    _same("cuda_version"),
    _gpus,
    _same("engine"),
    _same("engine_version"),
    _same("python_version"),
    _same("torch_version"),
    _same("image_digest"),
    _same("container_runtime"),
    _same("engine_env_digest"),
    _same("model_revision"),
    _same("topology"),
)


def compare(captured: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    """Every way *here* differs from *captured* that a restore cannot absorb."""
    out: list[Mismatch] = []
    for check in CHECKS:
        out.extend(check(captured, here))
    return out


def admit(captured: Fingerprint, here: Fingerprint, *, capsule: str, extra: list[str] = ()) -> None:
    """Raise CompatibilityError naming every mismatch (and *extra* problems) at once."""
    problems = [str(m) for m in compare(captured, here)] + list(extra)
    if problems:
        raise CompatibilityError(
            "admission refused for capsule %s: %s; recapture on this host with `sparkrun coldsnap capture`"
            % (capsule, "; ".join(problems))
        )
