"""The n610 driver in a Docker container: the order of the CUDA checkpoint calls around docker's.

There is no Docker on the GPU machines (docs/architecture.md), and no GPU here, so the
ordering runs against ``FakeCheckpointApi`` (the fake of the CUDA driver's checkpoint
API, with the driver's states and errors: tests/test_cuda_checkpoint.py) and
``FakeContainerRuntime``, a fake of docker's part that records what happens when, keeps
a container's processes in the CUDA states the fake API holds, and fails where told.
Docker's real part is the CPU container path, tested with real docker in
tests/test_containers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cuda_checkpoint import FakeCheckpointApi

from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.launch import gpu_container as gc
from sparkrun_coldsnap.launch import gpu_devices

HOST_PIDS = [4101, 4102]  # the API server and the engine core, as the host sees them
NS_PIDS = {4101: 1, 4102: 24}  # the same processes inside the container's PID namespace


class FakeContainerRuntime:
    """A fake of docker's checkpoint and checkpoint start, sharing one event log with the API.

    A checkpoint needs every CUDA process checkpointed first (CRIU cannot dump open
    device files); a start brings the processes back under new host PIDs, still
    checkpointed, as CRIU and the CUDA driver do.
    """

    def __init__(self, api: FakeCheckpointApi, *, fail: str | None = None, restored_pids=(5201, 5202)):
        self.api, self.fail = api, fail
        self.events: list[str] = []
        self.restored = dict(zip(restored_pids, NS_PIDS.values()))
        self.removed = False

    def checkpoint(self, unit, images: Path) -> None:
        self.events.append("docker checkpoint")
        assert all(self.api.states[p] == "checkpointed" for p in HOST_PIDS), "CRIU ran while a process still held the GPU"
        if self.fail == "checkpoint":
            raise CaptureError("docker checkpoint of unit failed: criu failed")

    def start(self, prepared, name: str):
        self.events.append("docker start --checkpoint")
        if self.fail == "start":
            raise RestoreError("docker start --checkpoint of %s failed" % name)
        for pid in self.restored:
            self.api.states[pid] = "checkpointed"
        return prepared

    def remove(self, unit) -> None:
        self.events.append("docker rm")
        self.removed = True

    def tree(self, unit) -> list[int]:
        return [1000, *self.restored]  # the container's init shell is no CUDA process


def ns_of_restored(runtime: FakeContainerRuntime):
    return lambda pid: runtime.restored.get(pid, 0)


def test_capture_locks_and_checkpoints_every_cuda_process_before_docker_checkpoints():
    api = FakeCheckpointApi(HOST_PIDS)
    rt = FakeContainerRuntime(api)
    data = gc.checkpoint(api, rt, object(), Path("images"), cuda_pids=HOST_PIDS, ns_of=NS_PIDS.__getitem__)
    assert [op for op, _ in api.calls] == ["lock", "lock", "checkpoint", "checkpoint"]
    assert rt.events == ["docker checkpoint"]
    assert data.model_dump(mode="json") == {"cuda_ns_pids": [1, 24]}  # what the restore maps back, not the host PIDs


def test_a_failed_docker_checkpoint_leaves_the_container_serving():
    api = FakeCheckpointApi(HOST_PIDS)
    rt = FakeContainerRuntime(api, fail="checkpoint")
    with pytest.raises(CaptureError, match="docker checkpoint"):
        gc.checkpoint(api, rt, object(), Path("images"), cuda_pids=HOST_PIDS, ns_of=NS_PIDS.__getitem__)
    assert [op for op, _ in api.calls][-4:] == ["restore", "restore", "unlock", "unlock"]
    assert set(api.states.values()) == {"running"}


def test_a_failed_rollback_is_reported_beside_the_first_error():
    api = FakeCheckpointApi(HOST_PIDS, fail={("restore", 4102): "CUDA_ERROR_ILLEGAL_STATE"})
    rt = FakeContainerRuntime(api, fail="checkpoint")
    with pytest.raises(CaptureError, match=r"docker checkpoint .*also failed.*4102.*CUDA_ERROR_ILLEGAL_STATE"):
        gc.checkpoint(api, rt, object(), Path("images"), cuda_pids=HOST_PIDS, ns_of=NS_PIDS.__getitem__)


def test_a_lock_timeout_never_reaches_docker():
    api = FakeCheckpointApi(HOST_PIDS, fail={("lock", 4102): "CUDA_ERROR_TIMEOUT"})
    rt = FakeContainerRuntime(api)
    with pytest.raises(CaptureError, match="cannot lock CUDA process 4102"):
        gc.checkpoint(api, rt, object(), Path("images"), cuda_pids=HOST_PIDS, ns_of=NS_PIDS.__getitem__)
    assert rt.events == [] and set(api.states.values()) == {"running"}


def test_no_cuda_process_is_refused_before_anything_happens():
    api = FakeCheckpointApi([])
    rt = FakeContainerRuntime(api)
    with pytest.raises(CaptureError, match="no process of the container holds a CUDA context"):
        gc.checkpoint(api, rt, object(), Path("images"), cuda_pids=[])
    assert rt.events == [] and api.calls == []


def test_restore_starts_the_container_then_restores_every_process_before_unlocking_any():
    api = FakeCheckpointApi([])
    rt = FakeContainerRuntime(api)
    gc.restore(api, rt, "prepared", "sparkrun_x_solo", cuda_ns_pids=[1, 24], ns_of=ns_of_restored(rt))
    assert rt.events == ["docker start --checkpoint"]
    assert api.calls == [("restore", 5201), ("restore", 5202), ("unlock", 5201), ("unlock", 5202)]
    assert api.states[5201] == api.states[5202] == "running" and not rt.removed


def test_a_failed_cuda_restore_removes_the_container():
    api = FakeCheckpointApi([], fail={("restore", 5202): "CUDA_ERROR_INVALID_VALUE"})
    rt = FakeContainerRuntime(api)
    with pytest.raises(RestoreError, match=r"CUDA restore of process 5202 failed \(CUDA_ERROR_INVALID_VALUE"):
        gc.restore(api, rt, "prepared", "n", cuda_ns_pids=[1, 24], ns_of=ns_of_restored(rt))
    assert rt.events == ["docker start --checkpoint", "docker rm"]
    assert ("unlock", 5201) not in api.calls  # nothing is unlocked before every process is restored


def test_a_process_missing_after_the_start_removes_the_container():
    api = FakeCheckpointApi([])
    rt = FakeContainerRuntime(api, restored_pids=(5201,))
    with pytest.raises(RestoreError, match="no process with PID 24 in its namespace"):
        gc.restore(api, rt, "prepared", "n", cuda_ns_pids=[1, 24], ns_of=ns_of_restored(rt))
    assert rt.removed and api.calls == []


def test_a_failed_start_makes_no_cuda_call():
    api = FakeCheckpointApi([])
    rt = FakeContainerRuntime(api, fail="start")
    with pytest.raises(RestoreError, match="docker start --checkpoint"):
        gc.restore(api, rt, "prepared", "n", cuda_ns_pids=[1, 24], ns_of=ns_of_restored(rt))
    assert api.calls == []


def test_gpus_become_spec_entries_devices_and_the_drivers_files_read_only(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libcuda.so.580.159.04").touch()
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (lib / "libcudart.so.13").touch()  # the toolkit's, inside the image: not the driver's
    args = gpu_devices.device_args(("1",), dev=dev, library_dirs=[str(lib)])
    assert args == [
        "--device", str(dev / "nvidia1"), "--device", str(dev / "nvidiactl"), "--device", str(dev / "nvidia-uvm"),
        "-v", "%s:%s:ro" % (lib / "libcuda.so.1", lib / "libcuda.so.1"),
        "-v", "%s:%s:ro" % (lib / "libcuda.so.580.159.04", lib / "libcuda.so.580.159.04"),
    ]  # fmt: skip
    with pytest.raises(CaptureError, match="GPU 7 has no device node"):
        gpu_devices.device_args(("7",), dev=dev, library_dirs=[str(lib)])


def test_a_solo_container_gets_the_hosts_gpus_or_those_cuda_visible_devices_names(tmp_path):
    # sparkrun's placement gives a single-host run no device list; a container sees only
    # the devices its spec names, so without these the engine finds no GPU at all.
    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    assert gpu_devices.host_gpus(None, dev=tmp_path) == ("0", "1", "10")
    assert gpu_devices.host_gpus("1", dev=tmp_path) == ("1",)
    assert gpu_devices.host_gpus("GPU-0d84ee44", dev=tmp_path) == ("0", "1", "10")
    assert gpu_devices.host_gpus("3", dev=tmp_path) == ()
    assert gpu_devices.host_gpus(None, dev=tmp_path / "absent") == ()


def test_a_solo_unit_in_a_container_is_given_the_gpus_unless_its_driver_is_the_cpu_one(monkeypatch):
    from helpers import synthetic_workload

    from sparkrun_coldsnap.documents.request import LaunchUnit, Topology
    from sparkrun_coldsnap.launch import containers

    monkeypatch.setattr(gpu_devices, "host_gpus", lambda visible: ("0",))
    solo = synthetic_workload().model_copy(update={"driver": "n610"})
    assert containers.unit_gpus(solo) == ("0",)
    assert containers.unit_gpus(solo.model_copy(update={"driver": "cpu"})) == ()
    ranked = solo.model_copy(update={"topology": Topology(hosts=("a",), units=(LaunchUnit(name="rank-0", host="a", rank=0, devices=("1",)),))})
    assert containers.unit_gpus(ranked) == ("1",)


def test_the_drivers_files_are_found_where_the_loader_finds_them(tmp_path):
    # Some machines keep the driver under /usr/local/nvidia/lib64 with links in /lib: the
    # container gets the files of both, or its engine finds no libcuda.
    real = tmp_path / "usr" / "local" / "nvidia" / "lib64"
    links = tmp_path / "lib"
    real.mkdir(parents=True)
    links.mkdir()
    (real / "libcuda.so.580.159.04").touch()
    (real / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (real / "libnvidia-ml.so.1").touch()
    (links / "libcuda.so.1").symlink_to(real / "libcuda.so.1")
    cache = "3 libs found in cache `/etc/ld.so.cache'\n"
    cache += "\tlibcuda.so.1 (libc6,x86-64) => %s\n\tlibnvidia-ml.so.1 (libc6,x86-64) => %s\n" % (links / "libcuda.so.1", real / "libnvidia-ml.so.1")
    cache += "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n"
    dirs = gpu_devices.driver_library_dirs(cache)
    assert dirs[: len(gpu_devices.LIBRARY_DIRS)] == list(gpu_devices.LIBRARY_DIRS)
    assert dirs[len(gpu_devices.LIBRARY_DIRS) :] == [str(links), str(real)]
    assert gpu_devices.driver_files([str(links), str(real)]) == [
        str(links / "libcuda.so.1"), str(real / "libcuda.so.1"), str(real / "libcuda.so.580.159.04"), str(real / "libnvidia-ml.so.1"),
    ]  # fmt: skip


def test_namespace_pids_are_read_from_proc(tmp_path):
    (tmp_path / "4102").mkdir()
    (tmp_path / "4102" / "status").write_text("Name:\tpython\nNSpid:\t4102\t24\n")
    assert gc.ns_pid(4102, proc=tmp_path) == 24


def test_a_driver_that_does_not_run_in_containers_is_refused_before_docker_is_asked(tmp_path):
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.drivers.n580 import N580Driver
    from sparkrun_coldsnap.launch.containers import Containers
    from sparkrun_coldsnap.launch.docker import ContainerSpec

    driver = N580Driver()
    assert not driver.in_containers
    with pytest.raises(CaptureError, match="snapshot driver n580 does not capture containers; use executor: local, or the cpu driver"):
        Containers().checkpoint(driver, object(), tmp_path / "images", unit_def=object(), progress=print)
    image = UnitImage(name="solo", host="localhost", driver="n580", root_pid=1, pids=(1,), pid_namespace=True)
    with pytest.raises(RestoreError, match="snapshot driver n580 does not restore containers"):
        Containers()._prepare(driver, image, tmp_path / "images", ContainerSpec("sha256:x", "serve", {}, {}), "coldsnap-restore-x")
