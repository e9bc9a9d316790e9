"""Faults of the engine and of concurrent operations, through the real API, real CRIU, the
FAKE SGLang server (tests/fakes/fake_sglang.py: SGLang's HTTP API in one small process tree)
and a FAKE GPU host (tests/gpu_fixtures.py): SGLang only runs on GPUs, so these take the n610
driver's steps, the CUDA checkpoint helper included, against fake CUDA driver bindings, and
run in seconds. Covered: the engine killed (kill -9) while a capture
waits for it, a restored workload whose reply differs, a second capture and a second restore
at the same time. After each: a receipt saying failed (or refused) with its phase and code, no
process, no staging left, nothing partial visible, and a retry that succeeds."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import hf_home
from gpu_fixtures import engine_env, fake_gpu_host, fake_gpu_state
from registry_fixtures import Registry, free_port

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule import gc
from sparkrun_coldsnap.capsule.capsule import open_capsule
from sparkrun_coldsnap.capsule.reference import parse
from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.capsule.transfer import publish
from sparkrun_coldsnap.documents.request import (
    CapsuleRef,
    CaptureRequest,
    Launch,
    LaunchUnit,
    ModelRef,
    RestoreRequest,
    Topology,
    ValidationSpec,
    Workload,
)
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, CompatibilityError, EngineError, NotFoundError, RestoreError, ValidationError
from sparkrun_coldsnap.host.process_tree import kill_tree

FAKE = Path(__file__).parent / "fakes" / "fake_sglang.py"


def snapshot() -> Path:
    return next((hf_home() / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots").iterdir())


def workload(port: int, startup: float = 1.0, snap: Path | None = None) -> Workload:
    snap = snap or snapshot()
    command = "%s %s --model-path %s --port %d --fake-startup-seconds %s" % (sys.executable, FAKE, snap, port, startup)
    return Workload(
        recipe="fault", engine="sglang", runtime="sglang", model=ModelRef(id="coldsnap/tiny-qwen2", revision=snap.name, path=str(snap)),
        topology=Topology(hosts=("localhost",), units=(LaunchUnit(name="solo", host="localhost"),)),
        launch=Launch(executor="local", command=command, port=port, env=engine_env()), driver="n610",
    )  # fmt: skip


def capture_request(port: int, name: str = "fault", startup: float = 1.0, snap: Path | None = None) -> CaptureRequest:
    return CaptureRequest(workload=workload(port, startup, snap), validation=ValidationSpec(prompt="hello", max_tokens=8), capsule=CapsuleRef(name=name), ready_timeout_seconds=60)


def restore_request(port: int, name: str = "fault", expected: str | None = None, snap: Path | None = None) -> RestoreRequest:
    return RestoreRequest(
        workload=workload(port, snap=snap), validation=ValidationSpec(prompt="hello", max_tokens=8, expected_reply=expected), capsule=CapsuleRef(name=name),
        on_missing="fail", on_incompatible="fail", workload_name="coldsnap-fault-test",
    )  # fmt: skip


def fake_processes(port: int) -> list[psutil.Process]:
    """The fake server on *port* and its process tree (its scheduler and detokenizer are spawned
    children whose command lines do not name the fake)."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if str(FAKE) in cmd and "--port %d " % port in cmd + " ":
                roots.append(p)
        except psutil.Error:
            continue
    out = []
    for p in roots:
        try:
            # A fresh handle: psutil's iterator hands back the one it made for the process the
            # capture stopped, and a restored process on that PID is not the one it knew.
            p = psutil.Process(p.pid)
            tree = [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
        for q in tree:
            try:
                if q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
            except psutil.Error:
                continue
    return out


def wait_no_process(port: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while fake_processes(port):
        assert time.monotonic() < deadline, "a process of the workload is left: %s" % fake_processes(port)
        time.sleep(0.05)


def nothing_staged(store: CapsuleStore) -> None:
    assert not store.staging.exists() or [p for p in store.staging.iterdir() if p.name not in ("uploads", "downloads")] == []


@pytest.fixture(scope="module", autouse=True)
def gpu_host(tmp_path_factory):
    with fake_gpu_host(tmp_path_factory.mktemp("fake-cuda")) as gpus:
        yield gpus


@pytest.fixture(scope="module")
def captured(criu, tmp_path_factory, gpu_host):
    tmp = tmp_path_factory.mktemp("fault-engine")
    port = free_port()
    store = CapsuleStore(tmp / "store")
    out = api.capture(capture_request(port), store=store)
    assert out.receipt.state == "succeeded"
    wait_no_process(port)
    return store, port, out.receipt


def test_the_engine_killed_while_capture_waits_for_it(criu, tmp_path):
    port = free_port()
    store = CapsuleStore(tmp_path / "store")
    result: dict = {}

    def run() -> None:
        try:
            api.capture(capture_request(port, startup=30), store=store)
        except ColdsnapError as err:
            result["err"] = err

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not fake_processes(port):
        assert time.monotonic() < deadline and t.is_alive(), result
        time.sleep(0.05)
    time.sleep(0.3)
    for p in fake_processes(port):
        p.kill()  # kill -9 of the engine
    t.join(60)
    err = result.get("err")
    assert isinstance(err, EngineError), result
    assert err.receipt is not None and err.receipt.state == "failed" and err.receipt.error is not None
    assert err.receipt.error.phase == "ready" and err.receipt.error.code == "engine.failed"
    wait_no_process(port)
    assert store.entries() == [] if store.root.exists() else True
    nothing_staged(store)
    out = api.capture(capture_request(port), store=store)  # the retry
    assert out.receipt.state == "succeeded"
    wait_no_process(port)


def test_a_capture_without_room_is_refused_before_the_dump_and_leaves_nothing(criu, tmp_path):
    """The store on a small tmpfs: the room check estimates the dump from the tree's memory
    and refuses before CRIU writes anything, naming the place, what it needs and the fix."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        port = free_port()
        store = CapsuleStore(small / "store")
        with pytest.raises(CaptureError) as caught:
            api.capture(capture_request(port), store=store)
        message = caught.value.message
        assert message.startswith("not enough disk space for the capture: writing the process images and packing them needs about"), message
        assert " in %s" % store.staging in message, message
        assert message.endswith("free space there, or put the capsule store on a larger disk (coldsnap.capsule.store); the engine this capture started has been stopped")
        r = caught.value.receipt
        assert r is not None and r.state == "failed" and r.error is not None and r.error.phase == "precheck"
        assert r.details["dump_estimate_bytes"] > 4 << 20
        assert not any(p.name == "checkpoint" for p in r.phases)
        wait_no_process(port)
        assert store.entries() == []
        nothing_staged(store)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_missing_capsule_starts_the_engine_vanilla_unless_told_to_fail(tmp_path):
    port = free_port()
    store = CapsuleStore(tmp_path / "empty-store")
    strict = restore_request(port, name="absent")
    with pytest.raises(NotFoundError, match=r"^capsule absent:latest is not in .* and the request says on_missing: fail: capture it first$"):
        api.prepare(strict, store=store)
    assert not fake_processes(port)
    plan = api.prepare(strict.model_copy(update={"on_missing": "vanilla"}), store=store)
    assert plan.prepared is None and plan.vanilla_because == "no capsule absent:latest in %s yet" % store.root
    notes: list[str] = []
    started = api.activate(plan, log_path=tmp_path / "vanilla.log", on_note=notes.append)
    try:
        assert started.how == "vanilla" and started.receipts == []
        r = started.outcome.receipt
        assert r.operation == "start" and r.state == "succeeded" and r.validation is not None and r.validation.passed and r.validation.reply
        assert r.details["instead_of_restore"] == plan.vanilla_because
        assert notes == ["%s: starting the engine vanilla (capture it with `sparkrun coldsnap capture`)" % plan.vanilla_because]
        assert started.outcome.root_pid in {p.pid for p in fake_processes(port)}
        reply = requests.post("http://127.0.0.1:%d/v1/chat/completions" % port, json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}, timeout=10).json()
        assert reply["choices"][0]["message"]["content"] == r.validation.reply
    finally:
        kill_tree(started.outcome.root_pid, grace=2.0)
    wait_no_process(port)
    assert store.entries() == [] if store.root.exists() else True


def test_a_changed_or_missing_model_file_is_refused_at_admission_and_the_original_restores(criu, tmp_path):
    """On a GPU the capsule holds no weights: the restore reloads the model files it recorded, so
    preparation (before sparkrun stops the old workload) checks each against its digest. The
    model is a private copy: changing the shared cache would change every other test's."""
    snap = tmp_path / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots" / snapshot().name
    shutil.copytree(snapshot(), snap)  # the cache's links followed: plain files of our own
    port = free_port()
    store = CapsuleStore(tmp_path / "store")
    out = api.capture(capture_request(port, name="weights", snap=snap), store=store)
    assert out.capsule is not None and out.capsule.config.weights.location == "external"
    wait_no_process(port)
    weights = snap / "model.safetensors"
    original = weights.read_bytes()
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0xFF  # same size, other bytes
    request = restore_request(port, name="weights", snap=snap)
    damage = {
        r"model file %s does not match the capsule \(sha256 .*\): restore the original file" % weights: lambda: weights.write_bytes(bytes(changed)),
        r"model file %s is missing: download model revision again" % weights: weights.unlink,
    }
    for expected, do in damage.items():
        do()
        with pytest.raises(CompatibilityError, match=expected) as caught:
            api.prepare(request, store=store)
        r = caught.value.receipt
        assert r is not None and r.state == "refused" and r.error is not None and r.error.phase == "prepare.admission" and caught.value.exit_code == 3
        assert not fake_processes(port)
        nothing_staged(store)
    weights.write_bytes(original)
    restored = api.restore(request, store=store)
    try:
        assert restored.outcome.receipt.state == "succeeded" and restored.outcome.receipt.validation.passed  # type: ignore[union-attr]
    finally:
        kill_tree(restored.outcome.root_pid, grace=2.0)
    wait_no_process(port)


def test_the_capture_released_and_the_restore_hydrated_through_the_gpu_steps(captured, use_settings):
    store, port, receipt = captured
    use_settings(page_fill_threads=2)
    cap = open_capsule(store, "fault:latest")
    unit = cap.config.units[0]
    assert cap.config.driver == "n610" and cap.config.weights.location == "external" and len(unit.driver_data.cuda_pids) == 1  # the scheduler
    done = api.restore(restore_request(port), store=store)
    try:
        r = done.outcome.receipt
        assert r.weights is not None and r.weights.path == "recovery" and "hydrate" in [p.name for p in r.phases]
        assert [fake_gpu_state.read_proc(pid)["state"] for pid in unit.driver_data.cuda_pids] == ["running"]
        # Preparation took the big memory areas out of the images; the restore wrote them back.
        split = r.details["staged_images"]["page_fill_split"]
        assert split["bytes_moved"] > 0 and r.details["page_fill"]["bytes"] == split["bytes_moved"], r.details
    finally:
        kill_tree(done.outcome.root_pid, grace=2.0)
    wait_no_process(port)


def test_a_recipe_changed_since_capture_is_refused_at_admission_and_a_place_only_change_is_not(captured, tmp_path):
    """Admission compares the recipe's workload with the captured one: a changed flag or
    variable is named and refused before anything is staged; what the guide and contracts call
    place-only (the recipe's file name, the model's directory, the Hugging Face cache) is not."""
    store, port, receipt = captured
    base = restore_request(port)
    w = base.workload
    changed = {
        "launch.command": w.model_copy(update={"launch": w.launch.model_copy(update={"command": w.launch.command + " --context-length 256"})}),
        "launch.env.EXTRA_FLAG": w.model_copy(update={"launch": w.launch.model_copy(update={"env": {**w.launch.env, "EXTRA_FLAG": "1"}})}),
    }
    for field, workload in changed.items():
        with pytest.raises(CompatibilityError, match="recipe changed since capture: %s: captured" % re.escape(field)) as caught:
            api.prepare(base.model_copy(update={"workload": workload}), store=store)
        r = caught.value.receipt
        assert r is not None and r.state == "refused" and r.error is not None and r.error.phase == "prepare.admission" and caught.value.exit_code == 3
        nothing_staged(store)
        assert not fake_processes(port)
    elsewhere = tmp_path / "elsewhere" / snapshot().name
    shutil.copytree(snapshot(), elsewhere)  # the same bytes in another directory
    env = {**w.launch.env, "HF_HOME": str(tmp_path / "elsewhere")}
    moved = w.model_copy(update={"recipe": "renamed", "model": w.model.model_copy(update={"path": str(elsewhere)}), "launch": w.launch.model_copy(update={"env": env})})
    plan = api.prepare(base.model_copy(update={"workload": moved}), store=store)
    try:
        assert plan.prepared is not None and plan.vanilla_because is None and plan.refused is None
    finally:
        plan.discard()
    nothing_staged(store)


def test_a_credential_in_the_engines_environment_reaches_no_config_receipt_or_registry_document(oci_registry, criu, tmp_path):
    """A hub token in the workload's environment: the engine gets it, but the capsule's config
    and manifest, the receipt and what the registry holds besides the process images carry its
    sha256 only. (The images are the engine's memory, its environment included.)"""
    secret = "hf_CaptureSecretValue0123456789"
    port = free_port()
    store = CapsuleStore(tmp_path / "store")
    req = capture_request(port, name="secret")
    req = req.model_copy(update={"workload": req.workload.model_copy(update={"launch": req.workload.launch.model_copy(update={"env": {**req.workload.launch.env, "HF_TOKEN": secret}})})})
    out = api.capture(req, store=store)
    wait_no_process(port)
    assert out.capsule is not None and out.capsule.config.workload.launch.env["HF_TOKEN"].startswith("sha256:")
    assert secret not in out.receipt.model_dump_json()
    layers = {d.digest for d in out.capsule.layers}
    for blob in (store.root / "blobs" / "sha256").iterdir():
        if "sha256:" + blob.name not in layers:
            assert secret.encode() not in blob.read_bytes(), blob
    assert secret.encode() not in (store.root / "index.json").read_bytes()
    registry = Registry(tmp_path / "registry").start()
    try:
        ref = parse("%s/capsules/secret:latest" % registry.host, default_tag=None)
        publish(store, "secret:latest", ref, RegistryClient(ref, Transport(plain_http=True)))
        held = [f for f in registry.storage.rglob("*") if f.is_file() and f.parent.name not in {d.split(":")[1] for d in layers}]
        assert held and not [f for f in held if secret.encode() in f.read_bytes()]
    finally:
        registry.stop()


def test_a_port_in_use_is_refused_at_capture_and_at_restore(captured, tmp_path):
    store, port, receipt = captured
    holder = socket.create_server(("127.0.0.1", port))
    try:
        other = CapsuleStore(tmp_path / "other")
        with pytest.raises(CaptureError, match="port %d is in use by .*pid %d" % (port, os.getpid())) as capture_err:
            api.capture(capture_request(port, name="taken"), store=other)
        assert capture_err.value.receipt is not None and capture_err.value.receipt.error.phase == "admission"  # type: ignore[union-attr]
        with pytest.raises(RestoreError, match="port %d is in use by .*pid %d" % (port, os.getpid())) as restore_err:
            api.restore(restore_request(port), store=store)
        assert restore_err.value.receipt is not None and restore_err.value.receipt.state == "failed"
        assert fake_processes(port) == []  # neither started an engine
    finally:
        holder.close()
    nothing_staged(store)
    assert not other.root.exists() or other.entries() == []


def test_a_reply_that_differs_fails_the_restore_and_leaves_nothing(captured):
    store, port, receipt = captured
    with pytest.raises(ValidationError) as caught:
        api.restore(restore_request(port, expected="not what it says"), store=store)
    r = caught.value.receipt
    assert r is not None and r.state == "failed" and r.error is not None
    assert r.error.phase == "validate" and r.error.code == "validation.failed" and r.details.get("workload_state") == "stopped"
    wait_no_process(port)
    nothing_staged(store)
    done = api.restore(restore_request(port), store=store)  # the retry, expecting what capture recorded
    try:
        assert done.outcome.receipt.validation is not None and done.outcome.receipt.validation.reply == receipt.validation.reply  # type: ignore[union-attr]
    finally:
        kill_tree(done.outcome.root_pid, grace=2.0)
    wait_no_process(port)


def test_a_second_restore_while_the_first_serves_is_refused_and_the_first_serves_on(captured):
    """The GPU drivers restore into the host's namespaces (CUDA does not initialize in a PID
    namespace of its own), so a second restore of the same capsule finds its captured PIDs
    taken and is refused at admission, before anything is staged; the first serves on. (The
    `cpu` driver restores into namespaces of its own: there both serve, each on its port.)"""
    store, port, receipt = captured
    first = api.restore(restore_request(port), store=store)
    try:
        with pytest.raises(CompatibilityError) as caught:
            api.prepare(restore_request(port), store=store)
        r = caught.value.receipt
        assert r is not None and r.state == "refused" and r.error is not None and r.error.phase == "prepare.admission"
        assert "captured PID" in caught.value.message and caught.value.exit_code == 3
        nothing_staged(store)
        reply = requests.post("http://127.0.0.1:%d/v1/chat/completions" % port, json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}, timeout=10).json()
        assert reply["choices"][0]["message"]["content"] == receipt.validation.reply  # type: ignore[union-attr]
    finally:
        kill_tree(first.outcome.root_pid, grace=2.0)
    wait_no_process(port)


def test_two_captures_into_one_store_at_once_both_complete_and_leave_no_garbage(criu, tmp_path):
    store = CapsuleStore(tmp_path / "store")
    ports = [free_port(), free_port()]
    results: list = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = api.capture(capture_request(ports[i], name="twin-%d" % i), store=store).receipt
        except ColdsnapError as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(getattr(r, "state", None) == "succeeded" for r in results), results
    assert sorted(e.ref or "" for e in store.entries()) == ["twin-0:latest", "twin-1:latest"]
    for ref in ("twin-0", "twin-1"):
        assert api.verify(ref, store=store).state == "succeeded"
    assert gc.collect(store, apply=False).items == []
    for port in ports:
        wait_no_process(port)
