"""Admission compares every fact and names every mismatch; plugins load through pluggy."""

from __future__ import annotations

import pluggy
import pytest

from sparkrun_coldsnap import extensions, hookspecs
from sparkrun_coldsnap.compat.fingerprint import compare
from sparkrun_coldsnap.documents.fingerprint import Fingerprint, TopologyFacts
from sparkrun_coldsnap.drivers.base import SnapshotDriver, Support
from sparkrun_coldsnap.engines.vllm import VllmAdapter
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host.facts import GpuInfo, cpu_features


def fp(**kw) -> Fingerprint:
    base = dict(
        cpu_arch="x86_64",
        cpu_features=("avx2", "fma", "sse4_2"),
        kernel_release="6.18.44",
        criu_version="4.2.1",
        nvidia_driver=None,
        cuda_version=None,
        gpus=(),
        engine="vllm",
        engine_version="0.32.0",
        python_version="3.11.7",
        torch_version="2.13.0+cpu",
        image_digest=None,
        engine_env_digest="sha256:" + "1" * 64,
        model_revision="a" * 40,
        topology=TopologyFacts(hosts=1, units=1, tensor_parallel=1, pipeline_parallel=1),
    )
    base.update(kw)
    return Fingerprint(**base)


def test_identical_fingerprints_admit():
    assert compare(fp(), fp()) == []


def test_every_mismatch_is_named_at_once():
    here = fp(
        kernel_release="6.1.0",
        criu_version="4.1.1",
        engine_version="0.33.0",
        cpu_features=("sse4_2",),
        nvidia_driver="580.159.04",
        gpus=(GpuInfo(name="NVIDIA H200", compute_capability="9.0"),),
        topology=TopologyFacts(hosts=2, units=2, tensor_parallel=2, pipeline_parallel=1),
    )
    fields = [m.field for m in compare(fp(), here)]
    assert fields == ["cpu_features", "kernel_release", "criu_version", "nvidia_driver", "gpu_count", "engine_version", "topology"]
    text = "; ".join(str(m) for m in compare(fp(), here))
    assert "kernel_release: captured 6.18.44, here 6.1.0" in text
    assert "cpu_features: captured has avx2, fma" in text


def test_more_cpu_features_and_another_gpu_of_the_same_model_are_fine():
    h200 = GpuInfo(name="NVIDIA H200", compute_capability="9.0", uuid="GPU-a")
    other = GpuInfo(name="NVIDIA H200", compute_capability="9.0", uuid="GPU-b")
    assert compare(fp(gpus=(h200,)), fp(gpus=(other,), cpu_features=("avx2", "fma", "sse4_2", "avx512f"))) == []
    assert [m.field for m in compare(fp(gpus=(h200,)), fp(gpus=(GpuInfo(name="NVIDIA H100", compute_capability="9.0"),)))] == ["gpus"]


def test_a_container_capsule_that_did_not_record_the_engine_inside_its_image_is_bound_by_the_image():
    image = "sha256:" + "2" * 64
    older = fp(image_digest=image, engine_version=None, python_version=None, torch_version=None, engine_env_digest=None)
    assert compare(older, fp(image_digest=image)) == []
    fields = [m.field for m in compare(older, fp(image_digest="sha256:" + "3" * 64))]
    assert fields == ["engine_version", "python_version", "torch_version", "image_digest", "engine_env_digest"]
    # Recorded, they are compared like any field.
    assert [m.field for m in compare(fp(image_digest=image), fp(image_digest=image, engine_version="0.33.0"))] == ["engine_version"]


def test_cpu_features_read_from_cpuinfo():
    assert cpu_features("processor: 0\nflags\t\t: fpu sse sse2 avx2 weird_flag\n") == ("avx2", "sse", "sse2")


def test_bundled_adapters_and_drivers_register_through_the_hooks():
    reg = extensions.collect(extensions.make_manager(load_entry_points=False))
    assert {"vllm", "sglang"} <= set(reg.engines)
    assert "cpu" in reg.drivers
    assert reg.engine_for_runtime("vllm-distributed").name == "vllm"
    with pytest.raises(RequestError, match="unknown engine 'tgi': use one of sglang, vllm"):
        reg.engine("tgi")
    with pytest.raises(RequestError, match="unknown snapshot driver 'magic'"):
        reg.driver("magic")


class ThirdPartyDriver(SnapshotDriver):
    """A third party's driver, registered through the real plugin manager."""

    name = "example"
    summary = "a third-party driver"

    def support(self, host):
        return Support(False, "example hardware absent")

    def precheck(self, root_pid):
        return []

    def checkpoint(self, root_pid, images, *, unit, host, progress):
        raise AssertionError("not used")

    def admission(self, unit):
        return []

    def restore(self, unit, images, *, log_path, progress):
        raise AssertionError("not used")


class ThirdParty:
    @hookspecs.hookimpl
    def register_drivers(self, register):
        register(ThirdPartyDriver())


def test_a_third_party_plugin_joins_the_registry():
    pm = extensions.make_manager(load_entry_points=False)
    pm.register(ThirdParty(), name="example-plugin")
    reg = extensions.collect(pm)
    assert reg.driver("example").summary == "a third-party driver"
    assert "cpu" in reg.drivers


def test_two_plugins_claiming_one_name_are_an_error():
    class Clash:
        @hookspecs.hookimpl
        def register_engines(self, register):
            register(VllmAdapter())

    pm = extensions.make_manager(load_entry_points=False)
    pm.register(Clash(), name="clash")
    with pytest.raises(RequestError, match="two engine plugins claim the name 'vllm'"):
        extensions.collect(pm)


def test_hookspecs_are_typed_and_documented():
    for name, takes in (("register_engines", "EngineAdapter"), ("register_drivers", "SnapshotDriver")):
        spec = getattr(hookspecs, name)
        assert spec.__doc__ and "Returns nothing." in spec.__doc__
        assert spec.__annotations__["register"] == "Callable[[%s], None]" % takes


def test_an_implementation_that_does_not_match_its_spec_is_refused():
    """The specs are the project manager's: an implementation asking for a parameter no spec
    offers is refused when it registers, not when the hook is first called."""

    class Wrong:
        @hookspecs.hookimpl
        def register_drivers(self, register, host):
            raise AssertionError("never called")

    pm = extensions.make_manager(load_entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="host"):
        pm.register(Wrong(), name="wrong")
