"""Several GPU ranks in one unit (cuda/ranks.py): the launch settings that keep their
collectives checkpointable, and the order of the CUDA checkpoint calls over every CUDA
process of the tree, against fakes of the checkpoint API.

The first tests run the order against ``FakeCheckpointApi`` (the driver's state machine, in
process). The last ones run a tree of FAKE GPU ranks (tests/workloads/ranks.py: a root and
two ranks on two fake GPUs, a ring of TCP connections on loopback) through the real helper
process, the fake CUDA driver bindings and real CRIU; the fake refuses what the driver
refuses, including device memory shared between ranks (CUDA IPC), where a call blocks
behind a locked peer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests
from gpu_fixtures import fake_gpu_host, fake_gpu_state, n610_checkpoint, start_fake_cuda_workload
from registry_fixtures import free_port
from test_criu_driver import wait_http
from test_cuda_checkpoint import FakeCheckpointApi

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda import ranks as gpu_ranks
from sparkrun_coldsnap.documents.request import LaunchUnit, Topology
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.drivers.n610 import N610Driver
from sparkrun_coldsnap.engines.sglang import SglangAdapter
from sparkrun_coldsnap.engines.vllm import VllmAdapter
from sparkrun_coldsnap.errors import CaptureError, RequestError
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids

RANKS = Path(__file__).parent / "workloads" / "ranks.py"
VLLM = "vllm serve /m --port 8000"


def topology(tp: int = 1, pp: int = 1, hosts: tuple[str, ...] = ("localhost",)) -> Topology:
    return Topology(hosts=hosts, tensor_parallel=tp, pipeline_parallel=pp, units=(LaunchUnit(name="solo", host=hosts[0]),))


# -- launch settings -------------------------------------------------------------------


def test_one_rank_launches_as_the_recipe_says():
    assert gpu_ranks.launch_settings(VLLM, {"A": "1"}, adapter=VllmAdapter(), topology=topology()) == (VLLM, {"A": "1"})


def test_tensor_parallel_ranks_get_collectives_that_share_no_device_memory():
    command, env = gpu_ranks.launch_settings(VLLM, {"A": "1"}, adapter=VllmAdapter(), topology=topology(tp=2))
    assert command == VLLM + " --disable-custom-all-reduce"  # communicators kept: graphs allowed, no extension
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0" and env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"  # one host: ranks meet on loopback
    assert env["A"] == "1"


def test_vllm_ranks_get_the_worker_extension_that_rebuilds_their_communicators_and_run_eagerly(use_settings):
    use_settings(rebuild_communicators=True)
    command, env = gpu_ranks.launch_settings(VLLM, {"PYTHONPATH": "/site"}, adapter=VllmAdapter(), topology=topology(tp=2))
    assert "--worker-extension-cls coldsnap_worker.ColdsnapWorker" in command and command.endswith(" --enforce-eager")
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /collective_rpc reaches every worker
    extension_dir, site = env["PYTHONPATH"].split(":")
    assert (Path(extension_dir) / "coldsnap_worker.py").is_file() and site == "/site"
    assert gpu_ranks.rebuilds_communicators(VllmAdapter(), topology(tp=2)) and not gpu_ranks.rebuilds_communicators(VllmAdapter(), topology())
    # The extension already there (native weights added it) is not given twice.
    again, _ = gpu_ranks.launch_settings(command, env, adapter=VllmAdapter(), topology=topology(tp=2))
    assert again.count("--worker-extension-cls") == 1 and again.count("--enforce-eager") == 1


def test_a_recipe_with_its_own_worker_extension_is_refused_for_several_ranks_whose_communicators_are_rebuilt(use_settings):
    assert gpu_ranks.launch_settings(VLLM + " --worker-extension-cls my.Ext", {}, adapter=VllmAdapter(), topology=topology(tp=2))[0].count("--worker-extension-cls") == 1
    use_settings(rebuild_communicators=True)
    with pytest.raises(RequestError, match=r"--worker-extension-cls my\.Ext .*remove it"):
        gpu_ranks.launch_settings(VLLM + " --worker-extension-cls my.Ext", {}, adapter=VllmAdapter(), topology=topology(tp=2))
    assert gpu_ranks.launch_settings(VLLM + " --worker-extension-cls my.Ext", {}, adapter=VllmAdapter(), topology=topology())[0].endswith("my.Ext")


def test_rebuilding_communicators_is_refused_for_an_engine_that_cannot_and_the_setting_is_checked(use_settings, monkeypatch):
    use_settings(rebuild_communicators=True)
    with pytest.raises(RequestError, match="COLDSNAP_COMMUNICATORS=rebuild: sglang's workers cannot"):
        gpu_ranks.launch_settings("sglang serve --model-path /m", {}, adapter=SglangAdapter(), topology=topology(tp=2))
    assert not gpu_ranks.rebuilds_communicators(SglangAdapter(), topology())  # one rank: nothing to rebuild
    monkeypatch.setenv("COLDSNAP_COMMUNICATORS", "sometimes")
    with pytest.raises(RequestError, match="COLDSNAP_COMMUNICATORS='sometimes' is not one of rebuild, keep"):
        Settings.from_environ()


def test_pipeline_parallel_counts_as_several_ranks_and_a_flag_already_there_is_kept():
    cmd = "sglang serve --model-path /m --disable-custom-all-reduce"
    command, env = gpu_ranks.launch_settings(cmd, {}, adapter=SglangAdapter(), topology=topology(pp=2))
    assert command == cmd and env["NCCL_P2P_DISABLE"] == "1"
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" not in env  # another engine's knobs stay out


def test_ranks_on_several_hosts_keep_the_interfaces_their_placement_chose():
    _, env = gpu_ranks.launch_settings(VLLM, {"GLOO_SOCKET_IFNAME": "eth0"}, adapter=VllmAdapter(), topology=topology(tp=2, hosts=("a", "b")))
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in env


def test_a_recipe_that_turns_a_shared_memory_transport_back_on_is_refused():
    with pytest.raises(RequestError, match=r"NCCL_P2P_DISABLE=0 in the engine's environment \(the recipe's or sparkrun's\): .* must run with NCCL_P2P_DISABLE=1"):
        gpu_ranks.launch_settings(VLLM, {"NCCL_P2P_DISABLE": "0"}, adapter=VllmAdapter(), topology=topology(tp=2))
    with pytest.raises(RequestError, match=r"NCCL_SOCKET_IFNAME=eth0 .* NCCL_SOCKET_IFNAME=lo"):
        gpu_ranks.launch_settings(VLLM, {"NCCL_SOCKET_IFNAME": "eth0"}, adapter=VllmAdapter(), topology=topology(tp=2))
    # The same value is no conflict.
    gpu_ranks.launch_settings(VLLM, {"NCCL_P2P_DISABLE": "1"}, adapter=VllmAdapter(), topology=topology(tp=2))


def test_an_engine_flag_that_shares_device_memory_is_refused():
    with pytest.raises(RequestError, match=r"--enable-symm-mem in the serve command: it makes the ranks share device memory"):
        gpu_ranks.launch_settings("sglang serve --enable-symm-mem --port 1", {}, adapter=SglangAdapter(), topology=topology(tp=2))


def test_the_n610_driver_applies_them_and_the_cpu_driver_does_not():
    from sparkrun_coldsnap.drivers.cpu import CpuDriver

    assert "NCCL_P2P_DISABLE" in N610Driver().launch_settings(VLLM, {}, adapter=VllmAdapter(), topology=topology(tp=2))[1]
    assert CpuDriver().launch_settings(VLLM, {}, adapter=VllmAdapter(), topology=topology(tp=2)) == (VLLM, {})


# -- the order over every CUDA process of the tree ------------------------------------

ROOT, RANK0, RANK1 = 100, 101, 102  # the API server holds a context too, as vLLM's does
TREE = [ROOT, RANK0, RANK1]


def test_capture_locks_every_rank_then_checkpoints_every_rank_then_dumps():
    api = FakeCheckpointApi(TREE)

    def dump():
        api.calls.append(("dump", 0))
        assert set(api.states.values()) == {"checkpointed"}  # nothing of the tree holds a GPU
        return "image"

    assert gpu_ranks.capture(api, TREE, dump) == "image"
    assert api.calls == [("lock", p) for p in TREE] + [("checkpoint", p) for p in TREE] + [("dump", 0)]


def test_restore_restores_every_rank_then_unlocks_every_rank():
    api = FakeCheckpointApi(TREE)
    gpu_ranks.capture(api, TREE, lambda: None)
    api.calls.clear()
    gpu_ranks.restore(api, TREE, [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")])
    assert api.calls == [("restore", p) for p in TREE] + [("unlock", p) for p in TREE]
    assert set(api.states.values()) == {"running"}


def test_a_failed_dump_puts_every_rank_back_to_running_in_the_restore_order():
    api = FakeCheckpointApi(TREE)

    def dump():
        raise CaptureError("criu dump of pid 100 failed")

    with pytest.raises(CaptureError, match="criu dump of pid 100 failed$"):
        gpu_ranks.capture(api, TREE, dump)
    assert api.calls[6:] == [("restore", p) for p in TREE] + [("unlock", p) for p in TREE]
    assert set(api.states.values()) == {"running"}


def test_a_rank_that_cannot_be_locked_leaves_every_rank_running_and_none_checkpointed():
    api = FakeCheckpointApi(TREE, fail={("lock", RANK1): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(CaptureError, match=r"cannot lock CUDA process 102 .*share device memory with a process already locked"):
        gpu_ranks.capture(api, TREE, lambda: pytest.fail("dumped"))
    assert api.calls == [("lock", ROOT), ("lock", RANK0), ("lock", RANK1), ("unlock", ROOT), ("unlock", RANK0)]
    assert set(api.states.values()) == {"running"}


class HangingApi(FakeCheckpointApi):
    """A call that never comes back: the helper is killed at its deadline and must be replaced."""

    def __init__(self, pids, hang):
        super().__init__(pids)
        self.hang, self.alive, self.restarts = hang, True, 0

    def _step(self, op, pid, want, to):
        assert self.alive, "a call on a helper that was killed"
        if (op, pid) == self.hang:
            self.hang = None
            self.alive = False
            self.calls.append((op, pid))
            raise cuda_checkpoint.CudaCallHung("no answer to %s of process %d within 1 s" % (op, pid))
        super()._step(op, pid, want, to)

    def state(self, pid):
        assert self.alive, "a call on a helper that was killed"
        self.calls.append(("state", pid))
        return super().state(pid)

    def restart(self):
        self.alive, self.restarts = True, self.restarts + 1


def test_a_call_that_hangs_behind_a_locked_peer_is_given_up_and_every_rank_resumed_by_a_fresh_helper():
    api = HangingApi(TREE, hang=("lock", RANK1))
    with pytest.raises(CaptureError, match=r"cannot lock CUDA process 102 .*no answer to lock of process 102"):
        gpu_ranks.capture(api, TREE, lambda: pytest.fail("dumped"))
    assert api.restarts == 1
    assert api.calls[3:] == [("unlock", ROOT), ("unlock", RANK0), ("state", RANK1)]
    assert set(api.states.values()) == {"running"}


def test_a_rank_that_fails_to_resume_is_named_beside_the_first_error():
    api = FakeCheckpointApi(TREE, fail={("unlock", RANK0): "CUDA_ERROR_UNKNOWN"})

    def dump():
        raise CaptureError("criu dump failed")

    with pytest.raises(CaptureError, match=r"criu dump failed; putting the CUDA processes back to running also failed: unlock 101: CUDA_ERROR_UNKNOWN"):
        gpu_ranks.capture(api, TREE, dump)


# -- FAKE GPU ranks through the helper, the fake driver bindings and real CRIU -----------


@pytest.fixture
def gpus(tmp_path, use_settings):
    with fake_gpu_host(tmp_path / "fake-cuda") as made:
        use_settings()
        yield made


def start_ranks(tmp_path: Path, port: int, *extra: str):
    cmd = "%s %s --port %d --ranks 2 %s" % (sys.executable, RANKS, port, " ".join(extra))
    # The root and two ranks each hold a context.
    unit = start_fake_cuda_workload(cmd, log_path=tmp_path / "ranks.log", visible="0,1", cuda_processes=3)
    assert wait_http("http://127.0.0.1:%d/allreduce" % port).strip() == "1"  # 0+0 + 0+1: the ring works
    return unit


def allreduce(port: int) -> str:
    return requests.get("http://127.0.0.1:%d/allreduce" % port, timeout=30).text.strip()


def test_two_ranks_on_two_gpus_are_captured_and_restored_with_their_ring(criu, tmp_path, gpus, use_settings):
    port = free_port()
    image = n610_checkpoint(start_ranks(tmp_path, port), tmp_path / "images")
    cuda_pids = image.driver_data.cuda_pids
    captured = {p: fake_gpu_state.read_proc(p)["gpus"][0]["uuid"] for p in cuda_pids}
    assert sorted(captured.values()) == sorted([gpus[0]["uuid"], gpus[0]["uuid"], gpus[1]["uuid"]])
    assert len(cuda_pids) == 3 and image.tcp_established  # the ring's connections are inside the tree
    assert list(image.driver_data.gpu_uuids) == [g["uuid"] for g in gpus]  # both GPUs, in the order the ranks see them
    use_settings(cuda_visible_devices="1,0")  # restored with the GPUs swapped
    driver = N610Driver()
    assert driver.admission(image) == []
    pid = driver.restore(image, tmp_path / "images", log_path=tmp_path / "restore.log", progress=lambda m: None).root_pid
    try:
        records = [fake_gpu_state.read_proc(p) for p in cuda_pids]
        assert [r["state"] for r in records] == ["running"] * 3
        swapped = {gpus[0]["uuid"]: gpus[1]["uuid"], gpus[1]["uuid"]: gpus[0]["uuid"]}
        assert [r["gpus"][0]["uuid"] for r in records] == [swapped[captured[p]] for p in cuda_pids]  # each rank onto the other GPU
        assert allreduce(port) == "3"  # 1+0 + 1+1: every rank ran its kernel and the ring carried the sums
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"
    finally:
        kill_tree(pid)


def test_a_capsule_of_two_ranks_is_refused_at_admission_where_one_gpu_is_visible(gpus, use_settings):
    from sparkrun_coldsnap.documents.unit_image import UnitImage

    both = [g["uuid"] for g in gpus]
    unit = UnitImage(name="solo", host="localhost", driver="n610", root_pid=2**22 + 1, pids=(2**22 + 1,), pid_namespace=False,
                     driver_data={"cuda_pids": [2**22 + 1], "gpu_uuids": both, "host_gpu_uuids": both})  # fmt: skip
    assert N610Driver().admission(unit) == []
    use_settings(cuda_visible_devices="1")
    assert N610Driver().admission(unit) == ["the capsule's workload used 2 GPUs but only 1 are visible here (CUDA_VISIBLE_DEVICES=1): make as many visible"]


def test_ranks_that_share_device_memory_are_refused_at_the_lock_and_left_serving(tmp_path, gpus):
    port = free_port()
    unit = start_ranks(tmp_path, port, "--ipc")
    api = cuda_checkpoint.HelperProcess(slack=0.05)  # a lock's deadline: (60 s + its 30 s timeout) x 0.05
    try:
        pids = cuda_checkpoint.cuda_processes(tree_pids(unit.root_pid))
        with pytest.raises(CaptureError, match=r"cannot lock CUDA process \d+ .*no answer to lock of process \d+ within [\d.]+ s.*left running"):
            gpu_ranks.capture(api, pids, lambda: pytest.fail("dumped"))
        assert api.alive  # a fresh helper took over from the one whose call hung
        assert [api.state(p) for p in pids] == ["running"] * 3
        assert allreduce(port) == "3"  # 1+0 + 1+1: the ranks serve on
    finally:
        api.close()
        kill_tree(unit.root_pid)


# -- through the API: a capture of two ranks (the FAKE SGLang server on a FAKE GPU host) ---


def two_rank_capture(port: int, env: dict[str, str] | None = None):
    from test_fault_engine import capture_request

    req = capture_request(port, name="ranks")
    w = req.workload
    launch = w.launch.model_copy(update={"command": w.launch.command + " --tp-size 2", "env": {**w.launch.env, **(env or {})}})
    return req.model_copy(update={"workload": w.model_copy(update={"topology": topology(tp=2), "launch": launch})})


def test_a_capture_of_two_ranks_launches_them_checkpointable_and_its_receipt_says_how(criu, tmp_path, gpus):
    from sparkrun_coldsnap import api
    from sparkrun_coldsnap.capsule.store import CapsuleStore

    out = api.capture(two_rank_capture(free_port()), store=CapsuleStore(tmp_path / "store"))
    assert out.receipt.state == "succeeded"
    added = out.receipt.details["driver_launch"]
    assert added["flags"] == ["--disable-custom-all-reduce"]
    assert {k: added["env"][k] for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_SOCKET_IFNAME")} == {
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo",
    }  # fmt: skip
    assert out.capsule is not None and out.capsule.config.workload.launch.command.endswith("--tp-size 2")  # the recipe's identity, unchanged


def test_a_capture_whose_environment_turns_p2p_back_on_is_refused_before_anything_starts(criu, tmp_path, gpus):
    from test_fault_engine import fake_processes

    from sparkrun_coldsnap import api
    from sparkrun_coldsnap.capsule.store import CapsuleStore

    port = free_port()
    with pytest.raises(RequestError, match=r"NCCL_P2P_DISABLE=0 in the engine's environment") as caught:
        api.capture(two_rank_capture(port, {"NCCL_P2P_DISABLE": "0"}), store=CapsuleStore(tmp_path / "store"))
    assert caught.value.receipt is not None and caught.value.receipt.state == "failed"
    assert fake_processes(port) == []
