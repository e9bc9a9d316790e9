"""What this host's platform means for a capture: architecture, NVIDIA driver branch, GPU model.

Read from the host's facts alone (no CUDA call), so doctor, capabilities and ``driver: auto``
can say before a capture what it will meet. What is known, by platform:

- DGX Spark (NVIDIA GB10, compute capability 12.1, aarch64): the GPU shares the host's
  memory (one pool, no separate device memory). With driver 580 the CUDA checkpoint API
  answers CUDA_ERROR_NOT_SUPPORTED (801), as public reports of GB10 owners say; which newer
  driver supports it there is not known here (no such driver was qualified).
- H100 and H200 (x86_64) with driver 580: the API works, as this project measured
  (580.159.04, docs/benchmarks.md).
- Other platforms: the minimum driver branches NVIDIA gives per architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkrun_coldsnap.host.facts import GpuInfo, HostFacts

# The process checkpoint API by architecture (NVIDIA's release notes).
MIN_X86 = 570
MIN_ARM = 595
ARM = ("aarch64", "arm64")
#: the GPU models whose checkpoint API was run by this project, on x86_64 with driver 580
QUALIFIED = ("H100", "H200")
QUALIFIED_BRANCH = 580
#: the pre-CUDA template (n580) runs from this branch on
TEMPLATE_MIN_BRANCH = 580


def driver_branch(version: str | None) -> int | None:
    """The driver's branch (its major version: 580 for 580.95.05), None where unknown."""
    try:
        return int((version or "").split(".")[0])
    except ValueError:
        return None


def is_gb10(gpu: GpuInfo) -> bool:
    """DGX Spark's chip: by its name, or by its compute capability (12.1) where the name says less."""
    return "GB10" in gpu.name.split() or gpu.compute_capability == "12.1"


@dataclass(frozen=True)
class Platform:
    arch: str
    driver_branch: int | None
    gpu_models: tuple[str, ...]
    #: the GPU shares the host's memory (GB10): no separate device memory to move
    unified_memory: bool
    #: the CUDA checkpoint API can be used here (n610); None where there is no NVIDIA GPU
    checkpoint_api: bool | None
    #: why, in words: the driver and chip it was judged on
    checkpoint_reason: str

    def summary(self) -> str:
        """One line: the platform, and what it implies for the GPU drivers."""
        if not self.gpu_models:
            return "%s, no NVIDIA GPU: CPU engines only (driver cpu)" % self.arch
        models = ", ".join(sorted(set(self.gpu_models)))
        memory = "; unified memory (the GPU shares the host's RAM)" if self.unified_memory else ""
        head = "%s, %s, driver branch %s%s" % (self.arch, models, self.driver_branch if self.driver_branch is not None else "unknown", memory)
        if self.checkpoint_api:
            return "%s: %s; n610 (the initialized CUDA process) can capture here" % (head, self.checkpoint_reason)
        if self.driver_branch is not None and self.driver_branch >= TEMPLATE_MIN_BRANCH:
            return "%s: %s: n610 cannot capture here; n580 (the pre-CUDA template) is what runs" % (head, self.checkpoint_reason)
        return "%s: %s: neither n610 nor n580 (driver >= %d) can capture here; update the NVIDIA driver" % (head, self.checkpoint_reason, TEMPLATE_MIN_BRANCH)


def _checkpoint_api(arch: str, branch: int | None, version: str | None, gpus: tuple[GpuInfo, ...]) -> tuple[bool | None, str]:
    if not gpus:
        return None, "no NVIDIA GPU on this host"
    if branch is None:
        return False, "unknown NVIDIA driver version"
    if arch in ARM and any(is_gb10(g) for g in gpus) and branch <= QUALIFIED_BRANCH:
        return False, "the CUDA checkpoint API is not supported by driver %d on GB10 (it answers CUDA_ERROR_NOT_SUPPORTED, 801; a newer driver that supports it is not yet qualified)" % branch
    need = MIN_ARM if arch in ARM else MIN_X86
    if branch < need:
        return False, "driver %s on %s: the process checkpoint API needs >= %d here; use the n580 driver" % (version, arch, need)
    if arch in ARM and any(is_gb10(g) for g in gpus):
        return True, "driver %d on GB10: the CUDA checkpoint API is expected, not qualified on GB10" % branch
    models = [g.name for g in gpus]
    if arch not in ARM and branch == QUALIFIED_BRANCH and all(any(q in m for q in QUALIFIED) for m in models):
        return True, "the CUDA checkpoint API works with driver %d on %s (qualified)" % (branch, ", ".join(sorted(set(models))))
    return True, "the CUDA checkpoint API is offered by driver %d on %s (not qualified on this GPU and driver)" % (branch, arch)


def reading(host: HostFacts) -> Platform:
    """What *host*'s facts imply."""
    gpus = host.gpu.gpus
    branch = driver_branch(host.gpu.nvidia_driver)
    ok, why = _checkpoint_api(host.cpu_arch, branch, host.gpu.nvidia_driver, gpus)
    return Platform(
        arch=host.cpu_arch,
        driver_branch=branch,
        gpu_models=tuple(g.name for g in gpus),
        unified_memory=any(is_gb10(g) for g in gpus),
        checkpoint_api=ok,
        checkpoint_reason=why,
    )
