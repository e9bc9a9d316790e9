"""The n610 driver end to end on a small CUDA-shaped workload: real CRIU, the real helper
process and its protocol, and the FAKE CUDA driver bindings (tests/fakes/fake_cuda).

The fake stands one level below the helper, where the GPU is: ``cuda/helper.py`` imports
it as ``cuda.bindings.driver`` and runs as it does on the GPU machine (JSON lines, UUIDs
written through ``CUuuid``'s address, errors named by ``CUresult``). The workload is
tests/workloads/server.py with ``--fake-cuda``: a server and a worker, each holding a
fake context (a device file under /dev, kernels that wait while locked). The driver's
rules the fake enforces are in its docstring; each test below breaks one of them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from gpu_fixtures import fake_gpu_host, fake_gpu_state, n610_checkpoint, start_fake_cuda_workload
from registry_fixtures import free_port
from test_criu_driver import wait_http

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.drivers.n610 import N610Driver
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids

SERVER = Path(__file__).parent / "workloads" / "server.py"


@pytest.fixture
def gpus(tmp_path, use_settings):
    """Two fake H200s; the plugin's helper finds the fake bindings first on its PYTHONPATH."""
    with fake_gpu_host(tmp_path / "fake-cuda") as made:
        use_settings()
        yield made


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def record(pid: int) -> dict:
    return fake_gpu_state.read_proc(pid)


def start(tmp_path: Path, port: int):
    cmd = "%s %s --port %d --fake-cuda" % (sys.executable, SERVER, port)
    # The server and its worker each hold a context.
    unit = start_fake_cuda_workload(cmd, log_path=tmp_path / "server.log", visible="0", cuda_processes=2)
    assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"
    return unit


def capture(tmp_path: Path, port: int):
    return n610_checkpoint(start(tmp_path, port), tmp_path / "images")


def restore(tmp_path: Path, image, name: str = "restore.log") -> int:
    driver = N610Driver()
    assert driver.admission(image) == []
    return driver.restore(image, tmp_path / "images", log_path=tmp_path / name, progress=lambda m: None).root_pid


def test_the_device_memory_a_checkpoint_moves_into_the_dump_is_what_the_driver_reports(tmp_path, gpus):
    unit = start(tmp_path, free_port())
    try:
        pids = tree_pids(unit.root_pid)
        assert N610Driver().device_memory(pids) == 2 * (512 << 20)  # two contexts of the fake's 512 MiB
        assert N610Driver().device_memory([unit.root_pid + 10**6]) == 0 and CpuDriver().device_memory(pids) == 0
    finally:
        kill_tree(unit.root_pid)


def test_a_cuda_tree_is_checkpointed_dumped_and_restored_through_the_helper(criu, tmp_path, gpus):
    port = free_port()
    image = capture(tmp_path, port)
    cuda_pids = image.driver_data.cuda_pids
    assert len(cuda_pids) == 2 and image.driver_data.driver_version == 13000
    assert list(image.driver_data.gpu_uuids) == [gpus[0]["uuid"]]  # the one its CUDA_VISIBLE_DEVICES shows
    assert list(image.driver_data.host_gpu_uuids) == [g["uuid"] for g in gpus]  # read back through CUuuid's bytes
    assert [record(p)["state"] for p in cuda_pids] == ["checkpointed"] * 2
    # what the helper loaded (its interpreter, here the fake bindings) is read before a restore
    helper_files = image.driver_data.helper_files
    assert any(f.endswith("/cuda/bindings/driver.py") for f in helper_files) and os.path.realpath(sys.executable) in helper_files, helper_files
    assert {Path(f) for f in helper_files} <= set(N610Driver().program_files([image]))
    pid = restore(tmp_path, image)
    try:
        assert [record(p)["state"] for p in cuda_pids] == ["running"] * 2
        assert sorted(cuda_checkpoint.cuda_processes(tree_pids(pid))) == sorted(cuda_pids)  # device files open again
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"  # kernels run: unlocked, on the GPU
    finally:
        kill_tree(pid)


def test_images_split_during_preparation_come_back_filled_before_the_cuda_restore(criu, tmp_path, gpus, use_settings):
    port = free_port()
    image = capture(tmp_path, port)
    use_settings(page_fill_threads=2)
    driver = N610Driver()
    staged = driver.stage_images(image, tmp_path / "images")
    assert staged is not None and staged["page_fill_split"]["bytes_moved"] > 0, staged
    restored = driver.restore(image, tmp_path / "images", log_path=tmp_path / "restore.log", progress=lambda m: None)
    try:
        assert restored.details["page_fill"]["bytes"] == staged["page_fill_split"]["bytes_moved"]
        assert [record(p)["state"] for p in image.driver_data.cuda_pids] == ["running"] * 2
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"
    finally:
        kill_tree(restored.root_pid)


def test_restoring_onto_the_other_gpu_maps_every_gpu_of_the_capture_host(criu, tmp_path, gpus, use_settings):
    port = free_port()
    image = capture(tmp_path, port)
    use_settings(cuda_visible_devices="1")
    pid = restore(tmp_path, image)
    try:
        assert {record(p)["gpus"][0]["uuid"] for p in image.driver_data.cuda_pids} == {gpus[1]["uuid"]}
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"
    finally:
        kill_tree(pid)


def test_a_gpu_of_another_chip_is_refused_and_the_restored_tree_stopped(criu, tmp_path, gpus, use_settings):
    port = free_port()
    image = capture(tmp_path, port)
    listing = fake_gpu_state.root() / "gpus.json"
    other = json.loads(listing.read_text())
    other[1]["chip"] = "NVIDIA H100"
    listing.write_text(json.dumps(other))
    use_settings(cuda_visible_devices="1")
    with pytest.raises(RestoreError, match=r"CUDA restore of process \d+ .*failed \(CUDA_ERROR_INVALID_VALUE, state checkpointed\)"):
        restore(tmp_path, image)
    assert not [p for p in image.pids if alive(p)]  # the half-restored tree was stopped


def test_a_gpu_gone_from_the_bus_fails_the_process_and_the_restore(criu, tmp_path, gpus):
    port = free_port()
    image = capture(tmp_path, port)
    Path(gpus[0]["device"]).unlink()
    with pytest.raises(RestoreError, match=r"CUDA restore of process \d+ .*failed \(CUDA_ERROR_UNKNOWN, state failed\)"):
        restore(tmp_path, image)


def test_a_lock_that_times_out_behind_a_long_kernel_leaves_the_workload_running(tmp_path, gpus):
    port = free_port()
    unit = start(tmp_path, port)
    api = cuda_checkpoint.HelperProcess()
    try:
        pids = cuda_checkpoint.cuda_processes(tree_pids(unit.root_pid))
        # One request each, given time: the server answers one at a time, and a retried request is queued behind.
        slow = threading.Thread(target=requests.get, args=("http://127.0.0.1:%d/slow" % port,), kwargs={"timeout": 30})
        slow.start()
        time.sleep(0.5)  # the server is inside its 3 s kernel
        with pytest.raises(CaptureError, match=r"cannot lock CUDA process %d .*within 300 ms \(CUDA_ERROR_TIMEOUT\).*left running" % unit.root_pid):
            cuda_checkpoint.checkpoint_all(api, [unit.root_pid, *[p for p in pids if p != unit.root_pid]], timeout_ms=300)
        assert [api.state(p) for p in pids] == ["running", "running"]
        slow.join()
        assert requests.get("http://127.0.0.1:%d/state" % port, timeout=30).text.strip() == "2"
    finally:
        api.close()
        kill_tree(unit.root_pid)
