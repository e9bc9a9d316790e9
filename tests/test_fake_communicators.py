"""The FAKE tensor-parallel vLLM's communicator (tests/fakes/fake_vllm_ranks.py) against the FAKE
CUDA driver (tests/fakes/fake_cuda), without the plugin's controller: with the fake driver
told to lose a communicator kept across a CUDA checkpoint (``FAKE_CUDA_KEPT_COMMUNICATORS=break``,
the driver ``COLDSNAP_COMMUNICATORS=rebuild`` is for), and by default carrying it. The last tests do the same for several ranks in one
unit (tests/workloads/ranks.py ``--nccl``), captured and restored by the n610 driver with real
CRIU.

Two ranks of the fake engine run here as two "hosts" on 127.0.0.1 (the head serving the API,
rank 1 ``--headless``), each on its own fake GPU, joined by their ring of TCP connections, the
fake's NCCL communicator. The cut is the plugin's own CUDA checkpoint helper over the fake
driver bindings, in the order of a cut across hosts (every process locked, then checkpointed,
then restored, then unlocked), with the processes left in place (no CRIU: the broken context
is the fake driver's state inside each process, which CRIU would carry along as it is).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from gpu_fixtures import fake_gpu_host, fake_gpu_state, n610_checkpoint
from registry_fixtures import free_port
from test_gpu_ranks import allreduce, start_ranks

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.drivers.n610 import N610Driver
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids

FAKE = Path(__file__).parent / "fakes" / "fake_vllm_ranks.py"
WORKER = "coldsnap_worker.ColdsnapWorker"
PROMPT = "hello across hosts"
LAUNCH_FAILURE = "hit an exception: CUDA error: unspecified launch failure"


@pytest.fixture
def gpus(tmp_path, use_settings, monkeypatch):
    """Fake GPUs whose driver loses a communicator kept across the cut (its processes inherit the setting)."""
    monkeypatch.setenv("FAKE_CUDA_KEPT_COMMUNICATORS", "break")
    with fake_gpu_host(tmp_path / "fake-cuda") as made:
        use_settings()
        yield made


@dataclass
class Engine:
    head: subprocess.Popen
    rank1: subprocess.Popen
    port: int
    logs: tuple[Path, Path]

    def url(self, path: str) -> str:
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def post(self, path: str, body: dict | None = None) -> requests.Response:
        return requests.post(self.url(path), json=body, timeout=60)

    def rpc(self, method: str) -> requests.Response:
        return self.post("/collective_rpc", {"method": method})

    def chat(self) -> str:
        body = {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
        r = self.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def cuda_pids(self) -> dict[str, int]:
        """The API server's, rank 0's and rank 1's CUDA processes."""
        head = cuda_checkpoint.cuda_processes(tree_pids(self.head.pid))
        rank1 = cuda_checkpoint.cuda_processes(tree_pids(self.rank1.pid))
        assert len(head) == 2 and len(rank1) == 1, (head, rank1)
        return {"api": self.head.pid, "rank-0": next(p for p in head if p != self.head.pid), "rank-1": rank1[0]}

    def posts(self) -> list[str]:
        """What the head was asked, in order: each POST's path, and the rpc a /collective_rpc named."""
        calls = [json.loads(line.split("fake-vllm call: ", 1)[1]) for line in self.logs[0].read_text().splitlines() if "fake-vllm call: " in line]
        return [c["path"] + (" " + c["rpc"] if "rpc" in c else "") for c in calls if c["method"] == "POST"]

    def ended(self) -> tuple[str, str]:
        """Both hosts' logs once both roots exited (a rank that ends takes its host's server with it)."""
        for proc in (self.head, self.rank1):
            proc.wait(timeout=30)
        return self.logs[0].read_text(), self.logs[1].read_text()

    def stop(self) -> None:
        for proc in (self.head, self.rank1):
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the root and its rank's worker
            except ProcessLookupError:
                pass
            proc.wait()


def start(tmp_path: Path, extension: str | None = WORKER) -> Engine:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"fake tensors of the fake model")
    port, master = free_port(), free_port()
    cmd = [sys.executable, str(FAKE), "--model", str(model), "--port", str(port), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(master), "--enable-sleep-mode"]
    cmd += ["--worker-extension-cls", extension] if extension else []
    procs, logs = [], []
    for rank in (0, 1):
        log = tmp_path / ("rank-%d.log" % rank)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(rank)}  # each rank on a GPU of its own
        extra = ["--node-rank", str(rank)] + (["--headless"] if rank else [])
        with log.open("wb") as out:
            procs.append(subprocess.Popen(cmd + extra, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    engine = Engine(procs[0], procs[1], port, (logs[0], logs[1]))
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(engine.url("/health"), timeout=5).status_code == 200:
                return engine
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline or engine.head.poll() is not None or engine.rank1.poll() is not None:
            engine.stop()
            pytest.fail("the fake engine did not start:\n%s\n%s" % (logs[0].read_text(), logs[1].read_text()))
        time.sleep(0.1)


def cut(pids: list[int]) -> None:
    """The CUDA half of a cut across hosts, the processes left where they are."""
    api = cuda_checkpoint.HelperProcess()
    try:
        cuda_checkpoint.lock_all(api, pids)
        cuda_checkpoint.checkpoint_locked(api, pids)
        assert [api.state(p) for p in pids] == ["checkpointed"] * len(pids)
        cuda_checkpoint.restore_each(api, pids)
        cuda_checkpoint.unlock_each(api, pids)
        assert [api.state(p) for p in pids] == ["running"] * len(pids)  # the driver sees nothing wrong
    finally:
        api.close()


def record(pid: int) -> dict:
    rec = fake_gpu_state.read_proc(pid)
    assert rec is not None, pid
    return rec


def wake_and_reload(engine: Engine) -> None:
    for path in ("/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache"):
        r = engine.rpc("reload_weights") if path == "/collective_rpc" else engine.post(path)
        assert r.status_code == 200, (path, r.text)


def served_then_asleep(engine: Engine) -> tuple[str, dict[str, int]]:
    """The reply before anything happened, and the processes holding contexts; the engine asleep (level 2)."""
    before, pids = engine.chat(), engine.cuda_pids()
    assert engine.post("/sleep?level=2").status_code == 200
    return before, pids


def test_ranks_that_keep_their_communicator_across_the_cut_fail_at_their_first_kernel(tmp_path, gpus):
    engine = start(tmp_path)
    try:
        _, pids = served_then_asleep(engine)
        assert [record(pids[r])["communicator"] for r in ("api", "rank-0", "rank-1")] == [False, True, True]  # the ranks hold the ring
        cut(list(pids.values()))
        assert [record(pids[r])["broken"] for r in ("api", "rank-0", "rank-1")] == [False, True, True]
        # Mapping memory and copying weights launch no kernel: they go through, as on the GPU machine.
        wake_and_reload(engine)
        with pytest.raises(requests.ConnectionError):
            engine.post("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8})
        head, rank1 = engine.ended()
        assert "Worker rank 0 %s" % LAUNCH_FAILURE in head, head
        assert "Worker rank 1 %s" % LAUNCH_FAILURE in rank1, rank1
    finally:
        engine.stop()


def test_a_driver_that_carries_kept_communicators_leaves_the_ranks_serving(tmp_path, gpus, monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_KEPT_COMMUNICATORS")
    engine = start(tmp_path)
    try:
        before, pids = served_then_asleep(engine)
        cut(list(pids.values()))
        assert [record(pids[r])["broken"] for r in ("api", "rank-0", "rank-1")] == [False, False, False]
        wake_and_reload(engine)
        assert engine.chat() == before
    finally:
        engine.stop()


def test_communicators_detached_before_the_cut_and_attached_after_it_give_the_same_reply(tmp_path, gpus):
    engine = start(tmp_path)
    try:
        before, pids = served_then_asleep(engine)
        r = engine.rpc("coldsnap_detach_communicators")
        assert r.status_code == 200, r.text
        assert r.json() == {"results": [{"rank": 0, "detached": ["tp:0"], "torch_nccl_initialized": []}, {"rank": 1, "detached": ["tp:0"], "torch_nccl_initialized": []}]}
        assert [record(pids[r])["communicator"] for r in ("rank-0", "rank-1")] == [False, False]
        cut(list(pids.values()))
        assert not any(record(p)["broken"] for p in pids.values())
        r = engine.rpc("coldsnap_attach_communicators")
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [(x["rank"], x["attached"]) for x in results] == [(0, ["tp:0"]), (1, ["tp:0"])]
        assert all(isinstance(x["seconds"], float) and x["seconds"] >= 0 for x in results), results
        assert [record(pids[r])["communicator"] for r in ("rank-0", "rank-1")] == [True, True]
        wake_and_reload(engine)
        assert engine.chat() == before
        assert engine.chat() == before  # the new ring carries one all-reduce after another
        assert engine.posts() == [
            "/v1/chat/completions", "/sleep?level=2", "/collective_rpc coldsnap_detach_communicators", "/collective_rpc coldsnap_attach_communicators",
            "/wake_up?tags=weights", "/collective_rpc reload_weights", "/wake_up?tags=kv_cache", "/v1/chat/completions", "/v1/chat/completions",
        ]  # fmt: skip
    finally:
        engine.stop()


def test_an_attach_with_nothing_detached_makes_nothing_and_a_second_detach_is_refused(tmp_path, gpus):
    """As the plugin's worker extension in the real vLLM does (tests/test_native_weights.py)."""
    engine = start(tmp_path)
    try:
        before = engine.chat()
        r = engine.rpc("coldsnap_attach_communicators")  # held from the start
        assert r.status_code == 200 and [x["attached"] for x in r.json()["results"]] == [[], []], r.text
        assert engine.chat() == before  # the ring it started with
        r = engine.rpc("coldsnap_detach_communicators")
        assert [x["detached"] for x in r.json()["results"]] == [["tp:0"], ["tp:0"]], r.text
        r = engine.rpc("coldsnap_detach_communicators")
        assert r.status_code == 500 and "rank 0's communicators are already detached (tp:0)" in r.json()["error"]["message"], r.text
        r = engine.rpc("coldsnap_attach_communicators")
        assert [x["attached"] for x in r.json()["results"]] == [["tp:0"], ["tp:0"]], r.text
        assert engine.chat() == before  # the ring of the attach
    finally:
        engine.stop()


def test_a_generation_on_detached_ranks_ends_them(tmp_path, gpus):
    engine = start(tmp_path)
    try:
        engine.chat()
        assert engine.rpc("coldsnap_detach_communicators").status_code == 200
        with pytest.raises(requests.ConnectionError):
            engine.post("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8})
        head, rank1 = engine.ended()
        destroyed = "the NCCL communicator of group tp:0 was destroyed (coldsnap_detach_communicators)"
        assert "Worker rank 0 hit an exception: RuntimeError: %s" % destroyed in head, head
        assert "Worker rank 1 hit an exception: RuntimeError: %s" % destroyed in rank1, rank1
    finally:
        engine.stop()


@pytest.mark.parametrize("extension", ["coldsnap_native_weights.NativeWeights", None])
def test_the_communicator_methods_are_unknown_without_coldsnaps_worker_class(tmp_path, gpus, extension):
    engine = start(tmp_path, extension)
    try:
        before = engine.chat()
        for method in ("coldsnap_detach_communicators", "coldsnap_attach_communicators"):
            r = engine.rpc(method)
            assert r.status_code == 400 and "Method %r not found in the workers" % method in r.json()["error"]["message"], r.text
        r = engine.rpc("reload_weights")
        assert r.status_code == 200 and r.json() == {"results": [{"rank": 0}, {"rank": 1}]}, r.text
        assert engine.chat() == before
    finally:
        engine.stop()


# -- several ranks in one unit (tests/workloads/ranks.py --nccl) through real CRIU --------


def restore_unit(tmp_path: Path, image) -> int:
    driver = N610Driver()
    assert driver.admission(image) == []
    return driver.restore(image, tmp_path / "images", log_path=tmp_path / "restore.log", progress=lambda m: None).root_pid


def test_ranks_in_one_unit_captured_with_their_communicator_fail_at_their_first_kernel_after_the_restore(criu, tmp_path, gpus):
    port = free_port()
    image = n610_checkpoint(start_ranks(tmp_path, port, "--nccl"), tmp_path / "images")
    broken = {p for p in image.driver_data.cuda_pids if record(p)["broken"]}
    assert len(broken) == 2 and image.root_pid not in broken  # the two ranks; the root held no communicator
    pid = restore_unit(tmp_path, image)
    try:
        assert [record(p)["state"] for p in image.driver_data.cuda_pids] == ["running"] * 3
        with pytest.raises(requests.ConnectionError):
            allreduce(port)
        logs = (tmp_path / "ranks.log").read_text() + (tmp_path / "restore.log").read_text()
        assert logs.count("CudaError: %s" % "CUDA error: unspecified launch failure") == 2, logs[-3000:]
    finally:
        kill_tree(pid)


def test_ranks_in_one_unit_detached_before_the_capture_and_attached_after_the_restore_all_reduce_again(criu, tmp_path, gpus):
    port = free_port()
    unit = start_ranks(tmp_path, port, "--nccl")
    assert requests.get("http://127.0.0.1:%d/detach" % port, timeout=30).text.strip() == "ok"
    image = n610_checkpoint(unit, tmp_path / "images")
    assert not any(record(p)["communicator"] or record(p)["broken"] for p in image.driver_data.cuda_pids)
    pid = restore_unit(tmp_path, image)
    try:
        assert requests.get("http://127.0.0.1:%d/attach" % port, timeout=30).text.strip() == "ok"
        assert allreduce(port) == "3"  # 1+0 + 1+1: every rank's kernel ran and the new ring carried the sums
        assert requests.get("http://127.0.0.1:%d/attach" % port, timeout=30).status_code == 500  # attached already
        assert allreduce(port) == "5"
    finally:
        kill_tree(pid)
