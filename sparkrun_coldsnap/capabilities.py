"""The machine-readable capabilities document: what this install can do, here."""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import Field

from sparkrun_coldsnap import __version__, extensions
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.documents.capsule_config import CAPSULE_FORMAT
from sparkrun_coldsnap.documents.receipts import RECEIPT_FORMAT
from sparkrun_coldsnap.documents.request import REQUEST_FORMAT
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.host import gpu_platform
from sparkrun_coldsnap.host.facts import HostFacts, host_facts

CAPABILITIES_FORMAT: Literal[1] = 1


class EngineCaps(Strict):
    name: str
    runtimes: tuple[str, ...]
    weight_paths: dict[str, tuple[str, ...]] = Field(description="Weight paths after restore, by platform (cpu, gpu).")


class DriverCaps(Strict):
    name: str
    summary: str
    weights: Literal["in-image", "external"]
    available_here: bool
    reason: str
    across_hosts: bool = Field(False, description="Captures and restores a workload sparkrun placed on several hosts (one launch unit per host, at one cut).")
    qualification: dict[str, Any] = Field(default_factory=dict, description="What has and has not been qualified on real hardware.")


class LauncherCaps(Strict):
    executor: str = Field(description="The recipe's executor this launch path serves (sparkrun's local or docker executor).")
    summary: str
    available_here: bool
    reason: str = Field(description="What it runs on here, or why it cannot capture here and how to fix that.")


class Formats(Strict):
    request: int
    capsule_config: int
    receipt: int
    capabilities: int
    artifact_type: str
    config_media_type: str
    layer_media_types: tuple[str, ...]
    companion_artifact_types: dict[str, str] = Field(description="Artifacts published beside a capsule: its model files (its subject) and its native weight payload (referring to it).")


class HostCaps(Strict):
    arch: str
    kernel: str
    nvidia_driver: str | None
    gpus: tuple[str, ...]
    driver_branch: int | None = Field(None, description="The NVIDIA driver's branch (its major version, e.g. 580); null without an NVIDIA GPU or where unknown.")
    compute_capabilities: tuple[str, ...] = Field((), description="Each GPU's compute capability, in the order of gpus (e.g. 12.1 for GB10, 9.0 for H100).")
    unified_memory: bool = Field(False, description="The GPU shares the host's memory (GB10, DGX Spark): no separate device memory.")
    cuda_checkpoint_api: bool | None = Field(None, description="Whether this driver and chip offer the CUDA checkpoint API the n610 driver needs (judged from the platform; null without an NVIDIA GPU).")
    platform: str = Field("", description="One line: the platform and what it implies for the snapshot drivers (e.g. that n610 cannot capture on GB10 with driver 580 and n580 is what runs).")
    auto_driver: str | None = Field(None, description="The driver a recipe's driver: auto captures with here (the first this host supports, by preference); null where none can.")


class Capabilities(Strict):
    format: Literal[1] = CAPABILITIES_FORMAT
    tool_version: str
    sparkrun_version: str | None
    engines: tuple[EngineCaps, ...]
    drivers: tuple[DriverCaps, ...]
    launchers: tuple[LauncherCaps, ...] = Field(description="The launch paths: host processes and containers, each with whether this host can capture and restore it.")
    formats: Formats
    stores: tuple[str, ...]
    host: HostCaps


def launchers() -> tuple[LauncherCaps, ...]:
    from sparkrun_coldsnap.errors import ColdsnapError
    from sparkrun_coldsnap.launch.units import LAUNCHERS

    out = []
    for executor, launcher in sorted(LAUNCHERS.items()):
        try:
            launcher.check_capturable()
            ok, reason = True, launcher.runtime_summary() or "the host itself (no container runtime)"
        except ColdsnapError as err:
            ok, reason = False, str(err)
        out.append(LauncherCaps(executor=executor, summary=launcher.summary, available_here=ok, reason=reason))
    return tuple(out)


def driver_caps(host: HostFacts) -> tuple[DriverCaps, ...]:
    """Every driver, by preference, with whether it can capture on *host*."""
    return tuple(DriverCaps(**d.capabilities(host)) for d in extensions.registry().drivers_by_preference())


def host_caps(host: HostFacts, drivers: tuple[DriverCaps, ...]) -> HostCaps:
    """*host*'s platform, what it implies, and the driver ``driver: auto`` picks among *drivers*."""
    plat = gpu_platform.reading(host)
    return HostCaps(
        arch=host.cpu_arch,
        kernel=host.kernel_release,
        nvidia_driver=host.gpu.nvidia_driver,
        gpus=tuple(g.name for g in host.gpu.gpus),
        driver_branch=plat.driver_branch,
        compute_capabilities=tuple(g.compute_capability for g in host.gpu.gpus),
        unified_memory=plat.unified_memory,
        cuda_checkpoint_api=plat.checkpoint_api,
        platform=plat.summary(),
        auto_driver=next((d.name for d in drivers if d.available_here), None),
    )


def collect() -> Capabilities:
    reg = extensions.registry()
    host = host_facts()
    try:
        sparkrun_version = importlib.metadata.version("sparkrun")
    except importlib.metadata.PackageNotFoundError:
        sparkrun_version = None
    engines = []
    for a in sorted(reg.engines.values(), key=lambda a: a.name):
        c = a.capabilities()
        engines.append(EngineCaps(name=c["name"], runtimes=tuple(c["runtimes"]), weight_paths={k: tuple(v) for k, v in c["weight_paths"].items()}))
    drivers = driver_caps(host)
    return Capabilities(
        tool_version=__version__,
        launchers=launchers(),
        sparkrun_version=sparkrun_version,
        engines=tuple(engines),
        drivers=drivers,
        formats=Formats(
            request=REQUEST_FORMAT,
            capsule_config=CAPSULE_FORMAT,
            receipt=RECEIPT_FORMAT,
            capabilities=CAPABILITIES_FORMAT,
            artifact_type=media.ARTIFACT_TYPE,
            config_media_type=media.CONFIG_MEDIA_TYPE,
            layer_media_types=(*media.LAYER_TYPES, *media.ENGINE_CACHE_TYPES),
            companion_artifact_types={"weights": media.WEIGHTS_ARTIFACT_TYPE, "native_weights": media.NATIVE_ARTIFACT_TYPE},
        ),
        stores=("oci-image-layout",),
        host=host_caps(host, drivers),
    )
