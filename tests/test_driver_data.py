"""A unit's driver data is a strict record whose JSON is the one capsules were written with."""

from __future__ import annotations

import pydantic
import pytest

from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.units import framing
from sparkrun_coldsnap.units.steps import STEPS, DevicesRestoreStep, RestoreAnswer, RestoreStep

# As capsule configs hold them: n610 on several hosts, n610 in a container, the cpu driver.
WRITTEN = [
    {
        "cuda_pids": [4242, 4250], "gpu_uuids": ["GPU-a"], "host_gpu_uuids": ["GPU-a", "GPU-b"], "driver_version": 13000,
        "helper_files": ["/usr/lib/libcuda.so.1"], "peer_connections": True, "peer_tcp": [["10.0.0.1", 41000, "10.0.0.2", 29500]],
        "native_files": ["rank-0.bin", "rank-0.json"],
    },
    {
        "cuda_ns_pids": [1, 24], "gpu_uuids": ["GPU-a"], "host_gpu_uuids": ["GPU-a"], "driver_version": 13000,
        "container": {"image": "sha256:" + "a" * 64, "command": "vllm serve /m", "env": {"HF_TOKEN": "sha256:" + "b" * 64}, "volumes": {"/cache": "/cache"},
                      "shm_size": "32g", "gpus": ["0"], "image_name": "vllm/vllm-openai:v0.26.0"},
        "runtime": "docker 28.1.1, overlay2, cgroup v2",
    },
    {"container": {"image": "sha256:" + "c" * 64, "command": "vllm serve /m", "env": {}, "volumes": {}, "shm_size": "16g"}, "runtime": "docker 28.1.1, overlay2, cgroup v2"},
    {},
]  # fmt: skip


def unit(driver_data: object) -> UnitImage:
    return UnitImage.model_validate({"name": "rank-0", "host": "a", "driver": "n610", "root_pid": 4242, "pids": [4242], "pid_namespace": False, "driver_data": driver_data})


@pytest.mark.parametrize("written", WRITTEN)
def test_a_capsules_driver_data_reads_and_writes_back_unchanged(written):
    image = unit(written)
    assert image.model_dump(mode="json")["driver_data"] == written
    assert UnitImage.model_validate_json(image.model_dump_json()) == image


@pytest.mark.parametrize("written", WRITTEN)
def test_driver_data_crosses_the_wire_as_itself(written):
    step = DevicesRestoreStep(driver="n610", data=unit(written).driver_data, visible="1")
    assert framing.read_request(framing.request(step), STEPS) == step
    restore = RestoreStep(image=unit(written), images="/staging/units/rank-0", name="rank-0")
    assert framing.read_request(framing.request(restore), STEPS) == restore


def test_an_unknown_key_or_a_wrong_type_is_refused():
    with pytest.raises(pydantic.ValidationError, match="cuda_pid"):
        unit({"cuda_pid": [1]})
    with pytest.raises(pydantic.ValidationError, match="peer_tcp"):
        unit({"peer_tcp": [["10.0.0.1", "not a port", "10.0.0.2", 29500]]})


def test_a_merge_takes_every_field_the_other_record_sets():
    dumped = DriverData(peer_connections=True, peer_tcp=(("10.0.0.1", 41000, "10.0.0.2", 29500),))
    locked = DriverData(cuda_pids=(4242,), gpu_uuids=("GPU-a",))
    both = dumped.merged(locked)
    assert both == DriverData(peer_connections=True, peer_tcp=dumped.peer_tcp, cuda_pids=(4242,), gpu_uuids=("GPU-a",))
    assert both.merged(DriverData(cuda_pids=())).cuda_pids == ()  # set, though empty
    assert both.merged(DriverData()) == both


def test_the_gpu_map_of_a_record_without_the_hosts_list_names_the_used_gpus():
    assert DriverData(gpu_uuids=("GPU-b",), host_gpu_uuids=("GPU-a", "GPU-b")).gpus() == (("GPU-b",), ("GPU-a", "GPU-b"))
    assert DriverData(gpu_uuids=("GPU-b",)).gpus() == (("GPU-b",), ("GPU-b",))
    assert DriverData().gpus() == ((), ())


def test_what_a_host_measured_of_a_restore_leaves_out_what_it_did_not_measure():
    answer = RestoreAnswer.model_validate({"pid": 7, "details": {"criu_restore_seconds": 1.25, "amx_permission": {"processes": 2, "refused": 0}}})
    assert framing.read_answer(RestoreStep(image=unit({}), images="/i", name="r"), framing.answer(answer)) == answer
    assert answer.details.model_dump(mode="json") == {"criu_restore_seconds": 1.25, "amx_permission": {"processes": 2, "refused": 0}}
    with pytest.raises(pydantic.ValidationError, match="page_fill"):
        RestoreAnswer.model_validate({"pid": 7, "details": {"page_fill": {"bytes": 1}}})
