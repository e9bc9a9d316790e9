"""Ordering and failure handling of the CUDA checkpoint calls, against a fake of the API.

CI has no GPU, so the driver's state machine is exercised here against
``FakeCheckpointApi``: a fake of the CUDA driver's process checkpoint API that
enforces the driver's documented transitions (RUNNING -lock-> LOCKED
-checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING) and fails the
way the driver does. The real API is exercised by benchmarks/gpu on the GPU
machine.
"""

from __future__ import annotations

import pytest

from sparkrun_coldsnap.criu.tree import pid_problems
from sparkrun_coldsnap.cuda import checkpoint as cc
from sparkrun_coldsnap.cuda.nvidia import checkpoint_api_problem
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.host.facts import GpuFacts, GpuInfo, HostFacts


class FakeCheckpointApi:
    """A fake of cuCheckpointProcess*: same states, same illegal-transition errors."""

    def __init__(self, pids, *, fail=None):
        self.states = {pid: "running" for pid in pids}
        self.fail = fail or {}  # (op, pid) -> CUDA error name
        self.calls: list[tuple[str, int]] = []

    def _step(self, op, pid, want, to):
        self.calls.append((op, pid))
        if (op, pid) in self.fail:
            raise cc.CudaCallError(self.fail[(op, pid)])
        if self.states.get(pid) != want:
            raise cc.CudaCallError("CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = to

    def state(self, pid):
        return self.states[pid]

    def lock(self, pid, timeout_ms):
        self._step("lock", pid, "running", "locked")

    def checkpoint(self, pid):
        self._step("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid, pairs):
        self._step("restore", pid, "checkpointed", "locked")

    def unlock(self, pid):
        self._step("unlock", pid, "locked", "running")

    def restore_many(self, pids, pairs, *, parallel):
        # The helper's contract (tested on the helper itself below): every restore before any
        # unlock; the first failure names its process and step, and nothing is unlocked after it.
        self.parallel = parallel
        for op in ("restore", "unlock"):
            for pid in pids:
                try:
                    getattr(self, op)(pid, *((pairs,) if op == "restore" else ()))
                except cc.CudaCallError as err:
                    raise cc.CudaCallError(str(err), pid=pid, op=op) from err
        return {pid: 0.0 for pid in pids}

    def uuids(self):
        return ["GPU-00000000-0000-0000-0000-000000000001"]

    def files(self):
        return []


PIDS = [101, 102, 103]


def test_every_process_is_locked_before_any_is_checkpointed():
    api = FakeCheckpointApi(PIDS)
    cc.checkpoint_all(api, PIDS)
    ops = [op for op, _ in api.calls]
    assert ops == ["lock"] * 3 + ["checkpoint"] * 3
    assert set(api.states.values()) == {"checkpointed"}


def test_every_process_is_restored_before_any_is_unlocked():
    api = FakeCheckpointApi(PIDS)
    cc.checkpoint_all(api, PIDS)
    api.calls.clear()
    cc.restore_all(api, PIDS)
    assert [op for op, _ in api.calls] == ["restore"] * 3 + ["unlock"] * 3
    assert set(api.states.values()) == {"running"}


def test_a_lock_timeout_leaves_the_workload_running():
    api = FakeCheckpointApi(PIDS, fail={("lock", 103): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(CaptureError, match=r"cannot lock CUDA process 103.*CUDA_ERROR_TIMEOUT.*left running"):
        cc.checkpoint_all(api, PIDS, timeout_ms=500)
    assert set(api.states.values()) == {"running"}
    assert not any(op == "checkpoint" for op, _ in api.calls)


def test_a_checkpoint_failure_rolls_back_the_ones_already_checkpointed():
    api = FakeCheckpointApi(PIDS, fail={("checkpoint", 102): "CUDA_ERROR_NOT_SUPPORTED"})
    with pytest.raises(CaptureError, match="CUDA checkpoint of process 102 failed"):
        cc.checkpoint_all(api, PIDS)
    assert set(api.states.values()) == {"running"}
    assert ("restore", 101) in api.calls and ("restore", 102) not in api.calls


def test_a_failed_rollback_is_reported_beside_the_first_error():
    api = FakeCheckpointApi(PIDS, fail={("checkpoint", 102): "CUDA_ERROR_NOT_SUPPORTED", ("unlock", 103): "CUDA_ERROR_UNKNOWN"})
    with pytest.raises(CaptureError, match="rolling back also failed: unlock 103"):
        cc.checkpoint_all(api, PIDS)


def test_a_restore_failure_names_the_process_and_its_state():
    api = FakeCheckpointApi(PIDS)
    cc.checkpoint_all(api, PIDS)
    api.fail[("restore", 102)] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(RestoreError, match=r"CUDA restore of process 102 failed \(CUDA_ERROR_OUT_OF_MEMORY, state checkpointed\)"):
        cc.restore_all(api, PIDS)


def test_gpu_remapping_only_when_the_gpus_differ():
    a, b = "GPU-a", "GPU-b"
    assert cc.gpu_pairs([a], [a, b], [a, b], [a, b]) == []
    assert cc.gpu_pairs([a, b], [a, b], [a, b], [a, b]) == []


def test_moving_onto_another_gpu_maps_every_gpu_of_the_capture_host():
    a, b, c = "GPU-a", "GPU-b", "GPU-c"
    # Captured on a alone (CUDA_VISIBLE_DEVICES=0), restored with CUDA_VISIBLE_DEVICES=1.
    assert cc.gpu_pairs([a], [a, b], [a, b], [b]) == [(a, b), (b, a)]
    # Captured seeing both, restored with them swapped.
    assert cc.gpu_pairs([a, b], [a, b], [a, b], [b, a]) == [(a, b), (b, a)]
    # Another host: the workload's GPU lands on the first one visible, the rest follow in order.
    x, y, z = "GPU-x", "GPU-y", "GPU-z"
    assert cc.gpu_pairs([b], [a, b, c], [x, y, z], [x, y, z]) == [(b, x), (a, y), (c, z)]


def test_restoring_onto_fewer_gpus_than_captured_is_refused(use_settings):
    use_settings(cuda_visible_devices="1")
    with pytest.raises(RestoreError, match=r"used 2 GPUs but only 1 are visible here \(CUDA_VISIBLE_DEVICES=1\)"):
        cc.gpu_pairs(["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], ["GPU-b"])
    with pytest.raises(RestoreError, match="captured on a host with 2 GPUs and this one has 1"):
        cc.gpu_pairs(["GPU-a"], ["GPU-a", "GPU-b"], ["GPU-x"], ["GPU-x"])


def test_a_workload_uses_the_gpus_it_sees_and_holds_memory_on():
    # vLLM without CUDA_VISIBLE_DEVICES on a two-GPU host sees both and works on the first:
    # it used one GPU, so CUDA_VISIBLE_DEVICES=1 may bring it back on the other (a swap).
    used = cc.workload_gpus(["GPU-a", "GPU-b"], ["GPU-a"])
    assert used == ["GPU-a"]
    assert cc.gpu_pairs(used, ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], ["GPU-b"]) == [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")]
    assert cc.workload_gpus(["GPU-b", "GPU-a"], ["GPU-a", "GPU-b", "GPU-c"]) == ["GPU-b", "GPU-a"]
    # Nothing reported by the driver: everything it sees counts.
    assert cc.workload_gpus(["GPU-a", "GPU-b"], []) == ["GPU-a", "GPU-b"]


def test_visible_gpus_follow_cuda_visible_devices():
    every = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]
    assert cc.visible_uuids(None, every) == every
    assert cc.visible_uuids("1", every) == ["GPU-bbbb-2"]
    assert cc.visible_uuids("2,0", every) == ["GPU-cccc-3", "GPU-aaaa-1"]
    assert cc.visible_uuids("GPU-bbbb", every) == ["GPU-bbbb-2"]
    assert cc.visible_uuids("cccc", every) == ["GPU-cccc-3"]
    # Like CUDA: the list ends at the first entry that names no GPU.
    assert cc.visible_uuids("0,7,1", every) == ["GPU-aaaa-1"]
    assert cc.visible_uuids("", every) == []


def host(driver, arch="x86_64"):
    gpus = (GpuInfo(name="NVIDIA H200", compute_capability="9.0"),) if driver else ()
    return HostFacts(cpu_arch=arch, cpu_features=(), kernel_release="6.18", gpu=GpuFacts(nvidia_driver=driver, gpus=gpus))


def test_driver_version_admission_by_platform():
    assert "no NVIDIA GPU" in checkpoint_api_problem(host(None))
    assert "needs >= 595" in checkpoint_api_problem(host("580.95.05", "aarch64"))
    assert "needs >= 570" in checkpoint_api_problem(host("550.54.14", "x86_64"))


def test_captured_pids_must_be_free(tmp_path):
    import os

    problems = pid_problems((os.getpid(),))
    assert problems and "captured PID %d is taken by" % os.getpid() in problems[0]
    assert pid_problems((2**22 + 12345,)) == []


# -- the helper's own call over several processes ----------------------------------------


class RecordingDriver:
    """FAKE driver bindings for the helper's ``restore_many``: each restore takes *seconds* (the
    restored process's own thread does the work; the call waits), and every call is logged with
    when it began and ended. Restore and unlock keep the driver's order rule: a process is
    unlocked only once restored."""

    def __init__(self, seconds=0.2, fail=None):
        import threading

        self.seconds, self.fail, self.log, self.lock = seconds, fail or {}, [], threading.Lock()
        self.states = {}

    def _call(self, op, pid, want, to):
        import time

        t = time.monotonic()
        if op == "restore":
            time.sleep(self.seconds)
        with self.lock:
            self.log.append((op, pid, t, time.monotonic()))
            if (op, pid) in self.fail:
                return (self.fail[(op, pid)],)
            if self.states.get(pid, "checkpointed") != want:
                return (NamedError("CUDA_ERROR_ILLEGAL_STATE"),)
            self.states[pid] = to
        return (0,)

    def cuCheckpointProcessRestore(self, pid, args):
        return self._call("restore", pid, "checkpointed", "locked")

    def cuCheckpointProcessUnlock(self, pid, args):
        return self._call("unlock", pid, "locked", "running")


class NamedError(str):
    """A CUresult-like error: non-zero, with a name."""

    name = property(lambda self: str(self))

    def __int__(self):
        return 1


def helper_with(driver):
    from sparkrun_coldsnap.cuda import helper as cuda_helper

    h = cuda_helper.Helper.__new__(cuda_helper.Helper)
    h.d = driver
    return h


@pytest.mark.parametrize("parallel", [True, False])
def test_the_helper_restores_every_process_before_unlocking_any(parallel):
    driver = RecordingDriver(seconds=0.2)
    answer = helper_with(driver).restore_many({"pids": [11, 12, 13], "pairs": [], "parallel": parallel})
    restores = [e for e in driver.log if e[0] == "restore"]
    unlocks = [e for e in driver.log if e[0] == "unlock"]
    assert sorted(e[1] for e in restores) == sorted(e[1] for e in unlocks) == [11, 12, 13]
    assert max(e[3] for e in restores) <= min(e[2] for e in unlocks)  # every restore ended before the first unlock began
    assert set(driver.states.values()) == {"running"} and sorted(answer["seconds"]) == ["11", "12", "13"]
    overlapped = max(e[2] for e in restores) < min(e[3] for e in restores)  # all three under way at one moment
    assert overlapped == parallel


def test_a_failed_restore_among_several_names_its_process_and_unlocks_none():
    from sparkrun_coldsnap.cuda import helper as cuda_helper

    driver = RecordingDriver(seconds=0.05, fail={("restore", 12): NamedError("CUDA_ERROR_OUT_OF_MEMORY")})
    with pytest.raises(cuda_helper.CallFailed) as raised:
        helper_with(driver).restore_many({"pids": [11, 12, 13], "parallel": True})
    assert str(raised.value) == "CUDA_ERROR_OUT_OF_MEMORY" and raised.value.fields == {"pid": 12, "op": "restore"}
    assert not [e for e in driver.log if e[0] == "unlock"]


def test_restores_go_in_parallel_unless_the_settings_say_serial(use_settings):
    use_settings()
    api = FakeCheckpointApi(PIDS)
    cc.checkpoint_all(api, PIDS)
    cc.restore_all(api, PIDS)
    assert api.parallel is True
    use_settings(cuda_restore_parallel=False)
    cc.checkpoint_all(api, PIDS)
    cc.restore_all(api, PIDS)
    assert api.parallel is False
