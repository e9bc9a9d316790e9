"""What doctor, capabilities and ``driver: auto`` conclude from a host's platform, against the
recorded facts of a DGX Spark (GB10, aarch64, driver 580), an H100 (x86_64, driver 580) and a
CPU host (tests/platforms/README.md says what each file is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkrun_coldsnap import capabilities, doctor
from sparkrun_coldsnap.cuda import nvidia
from sparkrun_coldsnap.documents.recipe_block import ColdsnapBlock
from sparkrun_coldsnap.host import facts, gpu_platform
from sparkrun_coldsnap.host.facts import GpuFacts, HostFacts
from sparkrun_coldsnap.integration import placement

PLATFORMS = Path(__file__).with_name("platforms")
GB10_LINE = "the CUDA checkpoint API is not supported by driver 580 on GB10"


def recorded(name: str) -> HostFacts:
    """The facts host/facts.py reads, parsed from what the platform's commands printed."""
    d = PLATFORMS / name
    query = d / "nvidia-smi-query.csv"
    gpu = facts.parse_gpu_facts(query.read_text(), (d / "nvidia-smi.txt").read_text()) if query.exists() else GpuFacts()
    return HostFacts(cpu_arch=(d / "uname-m").read_text().strip(), cpu_features=(), kernel_release="6.18", gpu=gpu)


@pytest.fixture
def on_platform(monkeypatch):
    """This process sees *name*'s recorded facts wherever it asks for the host's."""

    def use(name: str) -> HostFacts:
        host = recorded(name)
        for module in (facts, doctor):
            monkeypatch.setattr(module, "host_facts", lambda: host)
        return host

    return use


def test_the_recorded_facts_parse_as_each_platform_prints_them():
    gb10, h100, cpu = recorded("gb10"), recorded("h100"), recorded("cpu")
    assert (gb10.cpu_arch, gb10.gpu.nvidia_driver, gb10.gpu.cuda_version) == ("aarch64", "580.95.05", "13.0")
    assert [(g.name, g.compute_capability, g.memory_mib) for g in gb10.gpu.gpus] == [("NVIDIA GB10", "12.1", None)]  # its memory is the host's
    assert (h100.cpu_arch, h100.gpu.nvidia_driver, h100.gpu.cuda_version) == ("x86_64", "580.159.04", "13.0")
    assert [(g.name, g.compute_capability, g.memory_mib) for g in h100.gpu.gpus] == [("NVIDIA H100 80GB HBM3", "9.0", 81559)]
    assert cpu.gpu == GpuFacts()


def test_a_spark_on_driver_580_is_told_n610_is_not_supported_there_and_n580_runs():
    p = gpu_platform.reading(recorded("gb10"))
    assert (p.arch, p.driver_branch, p.gpu_models, p.unified_memory, p.checkpoint_api) == ("aarch64", 580, ("NVIDIA GB10",), True, False)
    assert GB10_LINE in p.checkpoint_reason and "not yet qualified" in p.checkpoint_reason
    line = p.summary()
    assert line.startswith("aarch64, NVIDIA GB10, driver branch 580; unified memory (the GPU shares the host's RAM): " + GB10_LINE)
    assert line.endswith("not yet qualified): n610 cannot capture here; n580 (the pre-CUDA template) is what runs")
    assert "\n" not in line
    # The API verdict of the n610 driver is the same sentence, before any CUDA call.
    assert nvidia.checkpoint_api_problem(recorded("gb10")) == p.checkpoint_reason


def test_an_h100_on_driver_580_keeps_the_checkpoint_api_and_a_cpu_host_has_no_gpu_driver():
    p = gpu_platform.reading(recorded("h100"))
    assert (p.arch, p.driver_branch, p.unified_memory, p.checkpoint_api) == ("x86_64", 580, False, True)
    assert p.checkpoint_reason == "the CUDA checkpoint API works with driver 580 on NVIDIA H100 80GB HBM3 (qualified)"
    assert p.summary().endswith("n610 (the initialized CUDA process) can capture here")
    cpu = gpu_platform.reading(recorded("cpu"))
    assert (cpu.driver_branch, cpu.checkpoint_api, cpu.unified_memory) == (None, None, False)
    assert cpu.summary() == "x86_64, no NVIDIA GPU: CPU engines only (driver cpu)"


def test_other_arm_and_old_x86_drivers_keep_their_minimum_branches():
    def host(name: str, cc: str, driver: str, arch: str) -> HostFacts:
        gpu = facts.parse_gpu_facts("%s, %s, 97871, GPU-0, %s\n" % (name, cc, driver), "")
        return HostFacts(cpu_arch=arch, cpu_features=(), kernel_release="6.18", gpu=gpu)

    gh200 = gpu_platform.reading(host("NVIDIA GH200 480GB", "9.0", "580.95.05", "aarch64"))
    assert not gh200.checkpoint_api and "needs >= 595" in gh200.checkpoint_reason and not gh200.unified_memory
    old = gpu_platform.reading(host("NVIDIA H100 80GB HBM3", "9.0", "550.54.14", "x86_64"))
    assert "needs >= 570" in old.checkpoint_reason and old.summary().endswith("neither n610 nor n580 (driver >= 580) can capture here; update the NVIDIA driver")
    assert gh200.summary().endswith("n580 (the pre-CUDA template) is what runs")
    later = gpu_platform.reading(host("NVIDIA GB10", "12.1", "595.10", "aarch64"))
    assert later.checkpoint_api and "not qualified on GB10" in later.checkpoint_reason


@pytest.mark.parametrize("name, libcuda_api, picked", [("gb10", True, "n580"), ("h100", True, "n610"), ("cpu", False, "cpu")])
def test_driver_auto_doctor_and_capabilities_agree_on_each_platform(criu, on_platform, monkeypatch, name, libcuda_api, picked):
    # Whether libcuda exports the API is this machine's fact, not the platform's: the recorded
    # H100 and GB10 have the driver's libcuda (580 exports it on both; GB10 refuses the calls).
    monkeypatch.setattr(nvidia, "has_checkpoint_api", lambda: libcuda_api)
    host = on_platform(name)
    assert placement._select_driver(ColdsnapBlock(), "vllm") == picked

    checks = {c.name: c for c in (*doctor._host(), *doctor._drivers())}
    assert checks["platform"].detail == gpu_platform.reading(host).summary()
    assert checks["driver auto"].status == "ok" and "captures with %s here" % picked in checks["driver auto"].detail
    if name == "gb10":
        assert checks["driver n610"].status == "warn" and GB10_LINE in checks["driver n610"].detail
        assert checks["driver n580"].status == "ok"

    caps = capabilities.host_caps(host, capabilities.driver_caps(host))
    assert caps.auto_driver == picked
    assert (caps.arch, caps.driver_branch, caps.unified_memory) == (host.cpu_arch, gpu_platform.driver_branch(host.gpu.nvidia_driver), name == "gb10")
    assert caps.cuda_checkpoint_api is {"gb10": False, "h100": True, "cpu": None}[name]
    assert caps.compute_capabilities == tuple(g.compute_capability for g in host.gpu.gpus)
    assert caps.platform == checks["platform"].detail
