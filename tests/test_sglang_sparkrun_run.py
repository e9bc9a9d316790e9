"""SGLang through sparkrun on a FAKE GPU host: ``sparkrun coldsnap capture`` and ``sparkrun run``
of a recipe with ``runtime: sglang``, the n610 driver's steps end to end.

sparkrun runs as a user runs it, in its own process; what it finds on this host is a GPU
host made of fakes (tests/gpu_fixtures.py): fake GPUs, a fake ``nvidia-smi``, the fake CUDA
driver bindings the plugin's checkpoint helper imports, a fake ``libcuda.so.1`` exporting the
checkpoint API's entry points (what the driver's support check looks for), and the FAKE
SGLang server (tests/fakes/fake_sglang.py), whose scheduler holds a fake CUDA context. CRIU,
sparkrun and the plugin are real. So the GPU path (release, CUDA lock and checkpoint, CRIU
dump, CUDA restore and unlock, hydration from the model files) runs as on the GPU machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest
import requests
from conftest import Sparkrun, base_env, write_recipe
from gpu_fixtures import engine_env, fake_gpu_host, fake_gpu_state
from registry_fixtures import Registry, free_port
from test_engine_cycle import copy_store, tamper
from test_fault_engine import FAKE, fake_processes, snapshot, wait_no_process

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.store import CapsuleStore

PROMPT = "hello"


def sglang_recipe(directory: Path, store: Path, port: int, *, block: str = "", capsule: str = "", validation: str = "") -> Path:
    """The tiny model's recipe with ``runtime: sglang`` and the fake server as its command; the
    engine's environment carries the fake GPU host's (its scheduler holds a fake CUDA context)."""
    directory.mkdir(parents=True, exist_ok=True)
    env = "".join("  %s: %s\n" % kv for kv in engine_env().items())
    command = "command: %s %s --model-path %s --port {port} --fake-startup-seconds 1\n" % (sys.executable, FAKE, snapshot())
    coldsnap = "coldsnap:\n%s  capsule:\n    name: fake-sglang\n    store: %s\n%s  validation:\n    prompt: %s\n    max_tokens: 8\n%s" % (block, store, capsule, PROMPT, validation)
    path = write_recipe(directory, coldsnap=coldsnap, name="fake-sglang.yaml", replace={"runtime: vllm": "runtime: sglang", "port: 8000": "port: %d" % port, "env:\n": "env:\n" + env})
    text = path.read_text()
    start = text.index("command:")
    path.write_text(text[:start] + command + text[text.index("coldsnap:") :])
    return path


def ask(port: int) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    r = requests.post("http://127.0.0.1:%d/v1/chat/completions" % port, json=body, timeout=30)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def pids(port: int) -> set[int]:
    return {p.pid for p in fake_processes(port)}


def fake_calls(text: str) -> list[tuple[str, str]]:
    """The (method, path) of each call the fake logged, in order."""
    out = []
    for line in text.splitlines():
        if "fake-sglang call: " in line:
            doc = json.loads(line.split("fake-sglang call: ", 1)[1])
            out.append((doc["method"], doc["path"]))
    return out


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    with fake_gpu_host(tmp_path_factory.mktemp("fake-cuda")) as gpus:
        yield gpus


@pytest.fixture(scope="module")
def captured(gpu_host, template_home, tmp_path_factory):
    """The recipe captured once through ``sparkrun coldsnap capture``: (home, store, recipe, port, receipt)."""
    import shutil

    tmp = tmp_path_factory.mktemp("sglang-sparkrun")
    home = tmp / "home"
    shutil.copytree(template_home, home, symlinks=True)
    sr = Sparkrun(home, base_env(home))  # this process's environment: the fake GPU host's
    store, port = tmp / "store", free_port()
    recipe = sglang_recipe(tmp / "recipe", store, port)
    sr.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(tmp / "capture.json"))
    wait_no_process(port)
    return home, store, recipe, port, json.loads((tmp / "capture.json").read_text())


@pytest.fixture
def sr(captured, tmp_path) -> Sparkrun:
    import shutil

    home = tmp_path / "home"
    shutil.copytree(captured[0], home, symlinks=True)
    return Sparkrun(home, base_env(home))


def test_capture_took_the_n610_steps_on_the_fake_gpu(captured):
    _, store, _, _, receipt = captured
    assert receipt["state"] == "succeeded" and receipt["validation"]["passed"] and receipt["validation"]["reply"]
    cap = capsule_mod.open_capsule(CapsuleStore(store), "fake-sglang:latest")
    unit = cap.config.units[0]
    assert cap.config.driver == "n610" and cap.config.engine.name == "sglang" and cap.config.weights.location == "external"
    assert len(unit.driver_data.cuda_pids) == 1 and list(unit.driver_data.host_gpu_uuids) == [g["uuid"] for g in fake_gpu_state.gpus()]
    names = [p["name"] for p in receipt["phases"]]
    assert names.index("validate") < names.index("release_memory") < names.index("checkpoint") < names.index("pack"), names


def test_sparkrun_run_restores_through_cuda_restore_and_hydration(captured, sr):
    _, store, recipe, port, receipt = captured
    out = sr("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        assert "restored fake-sglang:latest" in out.stderr + out.stdout, out.stderr[-2000:]
        assert ask(port) == receipt["validation"]["reply"]
        cap = capsule_mod.open_capsule(CapsuleStore(store), "fake-sglang:latest")
        (cuda_pid,) = cap.config.units[0].driver_data.cuda_pids
        assert fake_gpu_state.read_proc(cuda_pid)["state"] == "running" and cuda_pid in pids(port)
        r = json.loads(sorted((store / "receipts" / "fake-sglang").glob("*-restore.json"))[-1].read_text())
        assert r["state"] == "succeeded" and r["weights"]["path"] == "recovery" and "hydrate" in [p["name"] for p in r["phases"]]
        # What the restored server was asked, in order (sparkrun's logs read its fresh log):
        # weights' memory back, the weights loaded into it, the KV cache back, then the validation.
        logs = sr("logs", str(recipe), "-H", "localhost", "-n", "200").stdout
        asked = [c for c in fake_calls(logs) if c[1] != "/health"]
        assert asked[:4] == [("POST", "/resume_memory_occupation"), ("POST", "/update_weights_from_disk"), ("POST", "/resume_memory_occupation"), ("POST", "/v1/chat/completions")], logs[-3000:]
        assert "Up (pid" in sr("status", "-H", "localhost").stdout
    finally:
        sr("stop", str(recipe), "-H", "localhost")
    wait_no_process(port)


def test_the_old_workload_serves_on_through_a_failed_staging_and_a_failed_pull(captured, sr, tmp_path):
    """Both failures come before sparkrun stops the workload the run replaces: it keeps its
    processes and its reply, and the failed run leaves no staging, no capsule and no blob
    half-written. The recipes keep the file name, so each run replaces that same workload."""
    _, store, recipe, port, receipt = captured
    sr("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        before = pids(port)
        assert before and ask(port) == receipt["validation"]["reply"]

        # Staging: a layer of the capsule damaged in the store (another copy of it).
        damaged = copy_store(store, tmp_path)
        cap = capsule_mod.open_capsule(CapsuleStore(damaged), "fake-sglang:latest")
        layer = max(cap.layers, key=lambda d: d.size)
        tamper(CapsuleStore(damaged).blob_path(layer.digest))
        bad = sglang_recipe(tmp_path / "staging", damaged, port)
        cp = sr("run", str(bad), "-H", "localhost", "--no-follow", check=False)
        assert cp.returncode != 0 and "failed verification" in cp.stderr + cp.stdout, (cp.stdout + cp.stderr)[-3000:]
        assert pids(port) == before and ask(port) == receipt["validation"]["reply"]
        assert not [p for p in CapsuleStore(damaged).staging.iterdir() if p.name not in ("uploads", "downloads")]
        assert not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))
        refused = json.loads(sorted((damaged / "receipts" / "fake-sglang").glob("*-restore.json"))[-1].read_text())
        assert refused["state"] == "failed" and refused["error"]["code"] == "store.integrity"

        # Pull: the capsule published, then a layer damaged in the registry; this host's store is empty.
        registry = Registry(tmp_path / "registry").start()
        try:
            target = "%s/capsules/fake-sglang" % registry.host
            sr.coldsnap("publish", "fake-sglang", target + ":latest", "--store", str(store), "--plain-http")
            blob = registry.blob_file(layer.digest)
            data = bytearray(blob.read_bytes())
            data[len(data) // 2] ^= 0xFF
            blob.write_bytes(bytes(data))
            fresh = tmp_path / "fresh-store"
            pulling = sglang_recipe(tmp_path / "pull", fresh, port, block="  on_missing: fail\n", capsule="    repository: %s\n    plain_http: true\n" % target)
            cp = sr("run", str(pulling), "-H", "localhost", "--no-follow", check=False)
            assert cp.returncode != 0 and "does not match its digest" in cp.stderr + cp.stdout, (cp.stdout + cp.stderr)[-3000:]
        finally:
            registry.stop()
        assert pids(port) == before and ask(port) == receipt["validation"]["reply"]
        assert CapsuleStore(fresh).entries() == [] and not CapsuleStore(fresh).has_blob(layer.digest)
        assert "Up (pid" in sr("status", "-H", "localhost").stdout
    finally:
        sr("stop", str(recipe), "-H", "localhost")
    wait_no_process(port)


def test_a_restored_reply_that_differs_fails_the_run_stops_the_restored_tree_and_writes_a_failed_receipt(captured, sr, tmp_path):
    _, store, _, port, receipt = captured
    expecting = sglang_recipe(tmp_path / "expecting", store, port, validation="    expected_reply: not what it says\n")
    cp = sr("run", str(expecting), "-H", "localhost", "--no-follow", check=False)
    if cp.returncode == 0:  # it must not have served: stop what it started before failing
        sr("stop", str(expecting), "-H", "localhost", check=False)
    text = cp.stdout + cp.stderr
    assert cp.returncode != 0 and "not what it says" in text, text[-3000:]
    wait_no_process(port)
    cap = capsule_mod.open_capsule(CapsuleStore(store), "fake-sglang:latest")
    assert not [p for p in cap.config.units[0].pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    r = json.loads(sorted((store / "receipts" / "fake-sglang").glob("*-restore.json"))[-1].read_text())
    assert r["state"] == "failed" and r["error"]["phase"] == "validate" and r["error"]["code"] == "validation.failed"
    assert r["details"]["workload_state"] == "stopped" and r["validation"]["reply"] == receipt["validation"]["reply"] and not r["validation"]["passed"]
    assert not [p for p in CapsuleStore(store).staging.iterdir() if p.name not in ("uploads", "downloads")]


def lifecycle_row(sr: Sparkrun) -> dict:
    (row,) = json.loads(sr.coldsnap("status", "--json").stdout)
    return row


def asked_since(sr: Sparkrun, recipe: Path, mark: int) -> list[tuple[str, str]]:
    """What the server was asked after the *mark*-th call in its log, health checks left out."""
    calls = fake_calls(sr("logs", str(recipe), "-H", "localhost", "-n", "400").stdout)
    return [c for c in calls[mark:] if c[1] != "/health"]


def run_and_hibernate(sr: Sparkrun, recipe: Path, port: int, tmp_path: Path) -> str:
    """The recipe run from its capsule, then hibernated, with lifecycle records of the test's own; its workload name."""
    sr.env["COLDSNAP_LIFECYCLE_DIR"] = str(tmp_path / "lifecycle")
    sr("run", str(recipe), "-H", "localhost", "--no-follow")
    name = lifecycle_row(sr)["workload"]
    sr.coldsnap("hibernate", name)
    wait_no_process(port)
    return name


def test_warm_restores_the_tree_ahead_asleep_and_sparkrun_run_only_hydrates_and_validates(captured, sr, tmp_path):
    _, store, recipe, port, receipt = captured
    try:
        name = run_and_hibernate(sr, recipe, port, tmp_path)
        warm = json.loads(sr.coldsnap("warm", name, "--keep", "600", "--json").stdout)
        phases = [p["name"] for p in warm["phases"]]
        assert warm["state"] == "succeeded" and phases[-1] == "restore" and "prepare.stage" in phases, phases
        tree = warm["details"]["tree_pid"]
        row = lifecycle_row(sr)
        assert row["state"] == "warm" and row["warm"]["tree_pid"] == tree and row["root_pid"] == tree and row["host_memory_bytes"] > 0
        assert tree in pids(port) and "Up (pid" in sr("status", "-H", "localhost").stdout  # sparkrun sees the warm tree
        cap = capsule_mod.open_capsule(CapsuleStore(store), row["capsule"])
        (cuda_pid,) = cap.config.units[0].driver_data.cuda_pids
        assert fake_gpu_state.read_proc(cuda_pid)["state"] == "running"  # its GPU state is back
        mark = len(fake_calls(sr("logs", str(recipe), "-H", "localhost", "-n", "400").stdout))
        assert "process tree restored ahead (pid %d" % tree in sr.coldsnap("status", name).stdout

        out = sr("run", str(recipe), "-H", "localhost", "--no-follow")
        assert "workload %s was warm" % name in out.stderr and "stopping the workload this run replaces" not in out.stderr, out.stderr[-2000:]
        row = lifecycle_row(sr)
        assert row["state"] == "active" and row["root_pid"] == tree and row["warm"] is None
        activated = json.loads(Path(row["last_receipt"]).read_text())
        names = [p["name"] for p in activated["phases"]]
        assert activated["details"]["restored_ahead"] is True and names[-4:] == ["restore", "hydrate", "validate", "hydrate.release"] and "prepare.stage" not in names, names
        assert activated["validation"]["passed"] and ask(port) == receipt["validation"]["reply"]
        assert asked_since(sr, recipe, mark)[:3] == [("POST", "/resume_memory_occupation"), ("POST", "/update_weights_from_disk"), ("POST", "/resume_memory_occupation")]
    finally:
        sr("stop", str(recipe), "-H", "localhost", check=False)
    wait_no_process(port)


def test_a_warm_tree_is_ended_by_release_and_by_sparkrun_stop_and_images_only_restores_none(captured, sr, tmp_path):
    _, store, recipe, port, _ = captured
    try:
        name = run_and_hibernate(sr, recipe, port, tmp_path)
        # warm --release ends the tree it restored
        tree = json.loads(sr.coldsnap("warm", name, "--json").stdout)["details"]["tree_pid"]
        assert tree in pids(port)
        sr.coldsnap("warm", name, "--release")
        wait_no_process(port)
        assert lifecycle_row(sr)["state"] == "hibernated" and lifecycle_row(sr)["root_pid"] is None
        # sparkrun stop ends it too; the next command finds the workload hibernated, saying why
        tree = json.loads(sr.coldsnap("warm", name, "--json").stdout)["details"]["tree_pid"]
        sr("stop", str(recipe), "-H", "localhost")
        wait_no_process(port)
        row = lifecycle_row(sr)
        assert row["state"] == "hibernated" and row["warm"] is None and "(pid %d) was stopped" % tree in row["note"], row
        # --images-only: nothing runs while warm; sparkrun run restores from the images
        warm = json.loads(sr.coldsnap("warm", name, "--images-only", "--json").stdout)
        assert "tree_pid" not in warm["details"] and "restore" not in [p["name"] for p in warm["phases"]] and not pids(port)
        sr("run", str(recipe), "-H", "localhost", "--no-follow")
        activated = json.loads(Path(lifecycle_row(sr)["last_receipt"]).read_text())
        assert activated["details"]["staged_ahead"] is True and "restored_ahead" not in activated["details"]
    finally:
        sr("stop", str(recipe), "-H", "localhost", check=False)
    wait_no_process(port)


def test_the_lifecycle_follows_its_workload_when_every_run_is_named_anew(captured, sr, tmp_path):
    """On a cluster with sparkrun's default, status-aware scheduler every plan draws a new
    placement token: the same recipe run again has another name. The run replaces the workload
    of the same intent, and the verbs given the recipe find it."""
    _, store, recipe, port, receipt = captured
    sr.env["COLDSNAP_LIFECYCLE_DIR"] = str(tmp_path / "lifecycle")
    sr("cluster", "create", "sparse", "--hosts", "localhost")
    on = ("--cluster", "sparse")
    sr("run", str(recipe), *on, "--no-follow")
    try:
        first = lifecycle_row(sr)["workload"]
        out = sr("run", str(recipe), *on, "--no-follow")
        second = lifecycle_row(sr)["workload"]  # one row: the replaced workload's record went
        assert second != first and "restored fake-sglang:latest" in out.stderr, out.stderr[-2000:]
        assert ask(port) == receipt["validation"]["reply"]

        sr.coldsnap("hibernate", str(recipe), *on)
        wait_no_process(port)
        assert lifecycle_row(sr)["state"] == "hibernated"
        sr.coldsnap("warm", str(recipe), *on)  # the tree restored ahead, recorded under the old name
        tree = lifecycle_row(sr)["warm"]["tree_pid"]
        assert tree
        woke = json.loads(sr.coldsnap("wake", str(recipe), *on, "--json").stdout)
        row = lifecycle_row(sr)
        assert woke["state"] == "succeeded" and row["state"] == "active" and row["workload"] != second and row["root_pid"] == tree  # sparkrun left it to serve
        assert ask(port) == receipt["validation"]["reply"]
        assert "fake-sglang call" in sr("logs", str(recipe), *on, "-n", "50").stdout  # the new name reads the tree's log

        sr.coldsnap("hibernate", str(recipe), *on)
        wait_no_process(port)
        listed = sr.coldsnap("list", "--store", str(store)).stdout
        assert "hibernated-%s " % row["workload"] in listed and "hibernated-%s " % second not in listed, listed  # the older hibernation's tag went
    finally:
        sr("stop", str(recipe), *on, check=False)
    wait_no_process(port)
