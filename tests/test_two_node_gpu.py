"""The n610 driver across two hosts, through sparkrun's CLI: a tensor-parallel-2 workload with one
rank on each host of tests/two_hosts.py, captured with ``sparkrun coldsnap capture --cluster
two-node`` and restored by ``sparkrun run``.

What is real: sparkrun and its transport, the two hosts (network namespaces with their own
sshd), CRIU on each host through the unit agent, the plugin's CUDA checkpoint helper on each
host. What is FAKE, because this machine has no GPU: each host's GPUs, ``nvidia-smi`` and
``libcuda.so.1`` and the CUDA driver bindings the helper imports (tests/fakes/fake_cuda, one
fake GPU host per host, each host's own ``FAKE_CUDA_DIR``), and the engine: FAKE vLLM with
tensor parallel across hosts (tests/fakes/fake_vllm_ranks.py), whose head on the first host
serves the API and whose second rank runs on the other host, each rank holding a fake CUDA
context, the ranks joined by TCP connections between the hosts as NCCL's socket transport
joins them. Each host keeps native weight payloads on a disk of its own (a tmpfs at the
payload root in its mount namespace), as two machines do.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import coldsnap_home
from gpu_fixtures import FAKE_CUDA, H200, fake_gpu_state
from test_two_node_capture import no_process_left, one_line_error
from test_two_node_run import host_processes, rank_logs, run_logged, share_model_cache

CLUSTER = ("--cluster", "two-node")
FAKE = Path(__file__).parent / "fakes" / "fake_vllm_ranks.py"
REVISION = "973ff5dd93da77ddc2a1bffa8e29d4d207f245dd"  # recipes/tiny-vllm-cpu.yaml's
PROMPT = "hello across hosts"


@pytest.fixture(scope="module")
def gpu_hosts(two_hosts, tmp_path_factory):
    """Each test host with FAKE GPUs of its own (two H200s each) and the fake CUDA tools on
    every session's paths; the native payload root a disk of each host's own."""
    made, envs = {}, {}
    for host in two_hosts.hosts:
        directory = tmp_path_factory.mktemp("fake-cuda-%s" % host.name)
        made[host.name] = (directory, fake_gpu_state.make_host(directory, [H200, H200]))
        bin_dir = fake_gpu_state.install_tools(directory, sys.executable)
        envs[host.name] = {
            fake_gpu_state.ENV: str(directory), "PYTHONPATH": str(FAKE_CUDA), "LD_LIBRARY_PATH": str(directory / "lib"),
            "PATH": "%s:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" % bin_dir,
        }  # fmt: skip
    try:
        with two_hosts.host_env(envs, private=(coldsnap_home() / "native",)):
            yield made
    finally:
        for directory, _ in made.values():
            fake_gpu_state.remove_host(directory)


def recipe(directory: Path, store: Path, env: str = 'HF_HUB_OFFLINE: "1"') -> Path:
    path = directory / "fake-vllm-two-node.yaml"
    path.write_text(
        "\n".join([
            "recipe_version: \"2\"",
            "description: FAKE vLLM (tests) with tensor parallel 2, one rank on each of two hosts with FAKE GPUs",
            "model: coldsnap/tiny-qwen2",
            "model_revision: %s" % REVISION,
            "runtime: vllm-distributed",
            "executor: local",
            "defaults: {port: 8000, tensor_parallel: 2}",
            "env: {%s}" % env,
            "command: %s %s --model {model} --revision {model_revision} --host 0.0.0.0 --port {port} --tensor-parallel-size {tensor_parallel}" % (sys.executable, FAKE),
            "coldsnap:",
            "  driver: n610",
            "  capsule: {store: %s}" % store,
            "  validation: {prompt: %s, max_tokens: 8}" % PROMPT,
            "",
        ])
    )  # fmt: skip
    return path


def proc_records(gpu_hosts, name: str) -> dict[int, dict]:
    """What each process holding a fake context on host *name* last reported (its state, its GPU)."""
    directory, _ = gpu_hosts[name]
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in directory.glob("proc-*.json")}


def chat(address: str) -> str:
    body = {"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    req = urllib.request.Request("http://%s:8000/v1/chat/completions" % address, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def environ(pid: int) -> dict[str, str]:
    raw = Path("/proc/%d/environ" % pid).read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize("communicators", ["keep", "rebuild"])
def test_n610_captures_two_hosts_at_one_cut_and_sparkrun_run_restores_both_units_validated_through_rank_0(gpu_hosts, two_node, sparkrun, tmp_path, communicators):
    """keep: the fake driver carries the ranks' ring (their communicator) across the cut;
    rebuild: it would lose it, and the workers detach it after the sleep and attach it again
    after the unlock."""
    head, worker = two_node.hosts
    rebuild = communicators == "rebuild"
    sparkrun.env["COLDSNAP_COMMUNICATORS"] = communicators
    share_model_cache(sparkrun, "two-node")
    store = tmp_path / "store"
    path = recipe(tmp_path, store, 'HF_HUB_OFFLINE: "1", FAKE_CUDA_KEPT_COMMUNICATORS: break') if rebuild else recipe(tmp_path, store)
    try:
        out = run_logged(sparkrun, tmp_path / "capture.log", "coldsnap", "capture", str(path), *CLUSTER, "--receipt", str(tmp_path / "capture.json"))
        assert "captured fake-vllm-two-node:latest" in out, out
        assert no_process_left(two_node) == {head.address: set(), worker.address: set()}  # a capture stops what it started
        receipt = json.loads((tmp_path / "capture.json").read_text())
        names = [p["name"] for p in receipt["phases"]]
        assert names.index("validate") < names.index("native_export") < names.index("release_memory") < names.index("checkpoint") < names.index("publish"), names
        if rebuild:
            # The ring (the fake's NCCL communicator) is let go of before the cut: kept, this
            # fake driver would break the ranks' contexts.
            assert names.index("release_memory") < names.index("detach_communicators") < names.index("checkpoint"), names
            assert [(d["rank"], d["detached"]) for d in receipt["details"]["communicators_detached"]] == [(0, ["tp:0"]), (1, ["tp:0"])]
        else:
            assert "detach_communicators" not in names and "communicators_detached" not in receipt["details"]
        barriers = receipt["details"]["barriers"]
        assert list(barriers)[:4] == ["locked", "checkpointed", "quiesced", "dumped"], barriers
        launched = receipt["details"]["driver_launch"]
        assert launched["flags"] == ["--disable-custom-all-reduce", *(["--enforce-eager"] if rebuild else [])] and launched["env"]["NCCL_P2P_DISABLE"] == "1" and launched["env"]["NCCL_NET"] == "Socket"
        assert "NCCL_SOCKET_IFNAME" not in launched["env"]  # across hosts: not loopback, the placement's

        cfg = json.loads(sparkrun.coldsnap("inspect", "fake-vllm-two-node:latest", "--store", str(store), "--json").stdout)["config"]
        assert cfg["driver"] == "n610" and cfg["weights"]["location"] == "external" and cfg["weights"]["native"]
        units = {u["name"]: u for u in cfg["units"]}
        assert [(u["name"], u["host"]) for u in cfg["units"]] == [("rank-0", head.address), ("rank-1", worker.address)]
        for unit, host in (("rank-0", "a"), ("rank-1", "b")):
            data, gpus = units[unit]["driver_data"], gpu_hosts[host][1]
            assert data.get("communicators_detached") is (True if rebuild else None), data  # the restore attaches from this record
            assert data["gpu_uuids"] == [gpus[0]["uuid"]] and data["host_gpu_uuids"] == [g["uuid"] for g in gpus], data
            assert data["driver_version"] == 13000 and data["peer_connections"] and units[unit]["tcp_established"]
            assert all(proc_records(gpu_hosts, host)[p]["state"] == "checkpointed" for p in data["cuda_pids"])  # dumped checkpointed
        assert len(units["rank-0"]["driver_data"]["cuda_pids"]) == 2 and len(units["rank-1"]["driver_data"]["cuda_pids"]) == 1  # API server + rank; rank
        # Each host keeps the payload its own rank wrote, on its own disk.
        assert units["rank-0"]["driver_data"]["native_files"] == ["rank-0.bin", "rank-0.json"]
        assert units["rank-1"]["driver_data"]["native_files"] == ["rank-1.bin", "rank-1.json"]

        out = run_logged(sparkrun, tmp_path / "run.log", "run", str(path), *CLUSTER, "--no-follow")
        assert "distributed state restored 2/2" in out and "reply matches capture" in out, out
        # What the restored head was asked (its log: the newest of rank 0's), in order: every
        # rank's communicator made again, its weights memory back, filled from its own native
        # payload, KV cache back, validation.
        log = max(head.home.glob(".cache/sparkrun/**/*_node_0.log"), key=lambda p: p.stat().st_mtime).read_text()
        asked = [json.loads(line.split("fake-vllm call: ", 1)[1]) for line in log.splitlines() if "fake-vllm call: " in line]
        posts = [c["path"] + (" " + c["rpc"] if "rpc" in c else "") for c in asked if c["method"] == "POST"]
        attach = ["/collective_rpc coldsnap_attach_communicators"] if rebuild else []
        assert posts == [*attach, "/wake_up?tags=weights", "/collective_rpc coldsnap_load_native", "/wake_up?tags=kv_cache", "/v1/chat/completions"], posts
        assert chat(head.address) == cfg["validation"]["reply"]
        for unit, host in (("rank-0", "a"), ("rank-1", "b")):
            data, records = units[unit]["driver_data"], proc_records(gpu_hosts, host)
            assert [records[p]["state"] for p in data["cuda_pids"]] == ["running"] * len(data["cuda_pids"])  # restored, unlocked
            assert {records[p]["gpus"][0]["uuid"] for p in data["cuda_pids"]} == set(data["gpu_uuids"])  # on the GPU it was captured on
        rank1 = environ(units["rank-1"]["driver_data"]["cuda_pids"][0])  # the restored rank on the other host
        assert rank1["NCCL_P2P_DISABLE"] == "1" and rank1["NCCL_SHM_DISABLE"] == "1" and rank1.get("NCCL_SOCKET_IFNAME") != "lo"
        restored = json.loads(sorted((store / "receipts" / "fake-vllm-two-node").glob("*-restore.json"))[-1].read_text())
        assert restored["weights"]["path"] == "native" and restored["validation"]["passed"], restored
        assert list(restored["details"]["barriers"]) == ["network_held", "restored", "network_open", "adopted", "continued", "devices_restored", "unlocked"]

        status = sparkrun("status", *CLUSTER).stdout
        assert head.address in status and worker.address in status, status

        # The same recipe run again replaces the serving workload with a fresh restore of the
        # same capsule: the very connections between the hosts come back, held back on every
        # host until both ends are restored (else about one run in five lost one to a reset).
        for attempt in range(2):
            out = run_logged(sparkrun, tmp_path / ("again-%d.log" % attempt), "run", str(path), *CLUSTER, "--no-follow")
            assert "distributed state restored 2/2" in out and chat(head.address) == cfg["validation"]["reply"], out
        serving = {h.address: host_processes(h) for h in two_node.hosts}

        # Admission refused on one host only (its GPUs are another chip now): named with its
        # host and unit, before anything is stopped; the workload serves on untouched.
        listing = gpu_hosts["b"][0] / "gpus.json"
        original = listing.read_text()
        listing.write_text(original.replace(H200, "NVIDIA H100"))
        try:
            refused = sparkrun("run", str(path), *CLUSTER, "--no-follow", check=False)
        finally:
            listing.write_text(original)
        error = one_line_error(refused)
        assert "unit rank-1 on host %s" % worker.address in error and "NVIDIA H100" in error and "rank-0 on host" not in error, error
        assert {h.address: host_processes(h) for h in two_node.hosts} == serving
        assert chat(head.address) == cfg["validation"]["reply"]

        # A CUDA restore that fails on one host, after the old workload was stopped: every unit
        # on every host is torn down, and the error names the host and the unit.
        told = fake_gpu_state.tell_to_fail("restore", "CUDA_ERROR_OUT_OF_MEMORY", gpu_hosts["b"][0])
        try:
            failed = sparkrun("run", str(path), *CLUSTER, "--no-follow", check=False)
        finally:
            told.unlink()
        error = one_line_error(failed)
        assert "restoring the devices of unit rank-1 on host %s: CUDA restore of process" % worker.address in error, error
        assert "every unit restored has been stopped" in error, (failed.stdout + failed.stderr)[-3000:]
        assert no_process_left(two_node) == {head.address: set(), worker.address: set()}
    except AssertionError as err:
        raise AssertionError("%s\n%s" % (err, rank_logs(head, worker))) from None
    finally:
        sparkrun("stop", str(path), *CLUSTER, check=False)
    assert no_process_left(two_node) == {head.address: set(), worker.address: set()}


def test_a_cuda_checkpoint_that_fails_on_one_host_puts_both_units_back_to_running_and_publishes_nothing(gpu_hosts, two_node, sparkrun, tmp_path):
    head, worker = two_node.hosts
    share_model_cache(sparkrun, "two-node")
    path, store = recipe(tmp_path, tmp_path / "store"), tmp_path / "store"
    told = fake_gpu_state.tell_to_fail("checkpoint", "CUDA_ERROR_OUT_OF_MEMORY", gpu_hosts["b"][0])
    before = {h: set(proc_records(gpu_hosts, h)) for h in ("a", "b")}
    try:
        cp = sparkrun("coldsnap", "capture", str(path), *CLUSTER, check=False, timeout=900)
    finally:
        told.unlink()
    error = one_line_error(cp)
    assert "checkpointing the devices of unit rank-1 on host %s: CUDA checkpoint of process" % worker.address in error, error
    assert "CUDA_ERROR_OUT_OF_MEMORY" in error and "every unit still running was resumed with its devices back to running" in error, error
    assert "nothing was published" in error, error
    # Every CUDA process of both units was running again (host a's restored from its checkpoint,
    # host b's unlocked) before the capture stopped what it had started.
    for h in ("a", "b"):
        records = {pid: r for pid, r in proc_records(gpu_hosts, h).items() if pid not in before[h]}
        assert records and {r["state"] for r in records.values()} == {"running"}, (h, records)
    assert no_process_left(two_node) == {head.address: set(), worker.address: set()}
    index = store / "index.json"
    assert not index.exists() or "fake-vllm-two-node" not in index.read_text()
