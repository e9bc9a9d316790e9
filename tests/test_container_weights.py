"""Native weights for an engine in a container (weights/container_mounts.py): the payload's
directories bound at capture and restore at the same paths, the copy into memory in the one
shared tmpfs the container binds, and native refused where this host keeps them elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import make_capsule, synthetic_workload
from test_weights_memory import mounts

from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.driver_data import DriverData, RecordedContainer
from sparkrun_coldsnap.documents.request import Launch
from sparkrun_coldsnap.extensions import registry
from sparkrun_coldsnap.launch import containers
from sparkrun_coldsnap.launch.docker import ContainerSpec
from sparkrun_coldsnap.weights import container_mounts, native_payload, weight_paths, weights_memory
from sparkrun_coldsnap.weights.engine_side import DIRECTORY as ENGINE_SIDE_DIR

IMAGE = "coldsnap/vllm-gpu@sha256:" + "a" * 64


def gpu_container_workload():
    w = synthetic_workload("gpu-docker").model_copy(update={"driver": "n610"})
    return w.model_copy(update={"launch": Launch(executor="docker", image=IMAGE, command="vllm serve /m", port=8000)})


@pytest.fixture
def home(use_settings, tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    use_settings(home=tmp_path / "home")
    yield tmp_path / "home"
    root = container_mounts.shared_root()
    if os.path.ismount(root):
        os.system("umount -l %s" % root)


def test_a_gpu_container_binds_the_payloads_directories_at_the_hosts_own_paths(home, monkeypatch):
    from sparkrun_coldsnap.launch import gpu_devices

    monkeypatch.setattr(gpu_devices, "host_gpus", lambda visible: ())  # no GPU here: no device entries
    spec = containers.container_spec(gpu_container_workload(), "vllm serve /m", {})
    assert spec.weights_volumes == {"engine_side": str(ENGINE_SIDE_DIR), "native": str(home / "native"), "memory": str(home / "run" / "weights-memory-shared")}
    args = spec.create_args("c")
    binds = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    assert "%s:%s:ro" % (ENGINE_SIDE_DIR, ENGINE_SIDE_DIR) in binds  # the worker extension vLLM imports
    assert "%s:%s" % (home / "native", home / "native") in binds  # written at capture, read at restore
    assert "%s:%s" % ((home / "run" / "weights-memory-shared",) * 2) in binds
    # The CPU engine has no native payload: its containers stay as sparkrun makes them.
    cpu = containers.container_spec(gpu_container_workload().model_copy(update={"driver": "cpu"}), "vllm serve /m", {})
    assert cpu.weights_volumes == {} and not any(":ro" in a or "native" in a for a in cpu.create_args("c"))


def test_a_restore_binds_this_hosts_directories_at_the_paths_the_capture_recorded(home):
    recorded = {"engine_side": "/elsewhere/engine_side", "native": "/old/home/native", "memory": "/old/home/run/weights-memory-shared"}
    spec = ContainerSpec.from_json(ContainerSpec(image="sha256:" + "b" * 64, command="x", env={}, volumes={}, weights_volumes=recorded).to_json())
    assert spec.weights_volumes == recorded
    binds = [a for a in spec.create_args("c") if ":" in a and a.startswith("/")]
    assert "%s:/elsewhere/engine_side:ro" % ENGINE_SIDE_DIR in binds
    assert "%s:/old/home/native" % (home / "native") in binds
    # The engine is handed this host's paths: where they differ from the capture's, native is refused.
    assert "native directory at /old/home/native" in container_mounts.problem(recorded)
    assert container_mounts.problem(container_mounts.for_capture()) is None
    assert container_mounts.problem(None) == "the container was captured without the native payload's mounts"


def test_capture_writes_a_native_payload_for_a_gpu_container():
    w = gpu_container_workload()
    assert weight_paths.writes_native(w, registry().driver("n610"), registry().engine("vllm"))
    assert not weight_paths.writes_native(w.model_copy(update={"weights": "recovery"}), registry().driver("n610"), registry().engine("vllm"))


def sealed_payload(tmp_path: Path):
    staged = tmp_path / "export"
    staged.mkdir()
    (staged / "rank-0.bin").write_bytes(os.urandom(1 << 20))
    (staged / "rank-0.json").write_text('{"format": 1}')
    return native_payload.seal(staged)


def test_auto_takes_native_for_a_container_only_where_its_mounts_are_this_hosts(home, tmp_path):
    record = sealed_payload(tmp_path)
    cap = make_capsule(CapsuleStore(home / "store"), tmp_path, native=record)

    def in_container(volumes):
        unit = cap.config.units[0]
        data = DriverData(container=RecordedContainer(image="sha256:" + "c" * 64, command="x", env={}, volumes={}, weights_volumes=volumes))
        return cap.config.model_copy(update={"units": (unit.model_copy(update={"driver_data": data}),)})

    vllm = registry().engine("vllm")
    assert weight_paths.choose(in_container(container_mounts.for_capture()), "auto", vllm) == weight_paths.WeightChoice("native", native_payload.directory(record))
    moved = dict(container_mounts.for_capture(), native="/old/home/native")
    chosen = weight_paths.choose(in_container(moved), "auto", vllm)
    assert chosen.path == "recovery" and "native directory at /old/home/native" in chosen.note
    assert "restore with weights: auto or recovery" in weight_paths.choose(in_container(moved), "native", vllm).problem
    # A container captured before its engine could see the payload takes recovery too.
    assert weight_paths.choose(in_container(None), "auto", vllm).note == "the container was captured without the native payload's mounts"


def test_copies_for_containers_are_directories_of_one_shared_tmpfs_that_grows_with_them(home, tmp_path):
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "rank-0.bin").write_bytes(os.urandom((3 << 20) + 12345))
    (payload / "rank-0.json").write_text('{"format": 1}')
    first = weights_memory.copy_into_memory(sorted(payload.iterdir()), shared=True)
    second = weights_memory.copy_into_memory(sorted(payload.iterdir()), shared=True)
    root = container_mounts.shared_root()
    try:
        assert first.directory.parent == root == second.directory.parent and first.directory != second.directory
        assert mounts()[str(root)].startswith("tmpfs ") and str(first.directory) not in mounts()
        assert os.statvfs(root).f_blocks * os.statvfs(root).f_frsize >= first.bytes + second.bytes
        for f in payload.iterdir():
            assert (second.directory / f.name).read_bytes() == f.read_bytes()
    finally:
        first.release()
    # Releasing one copy removes its files; the tmpfs, bound into containers, stays mounted.
    assert not first.directory.exists() and second.directory.exists() and str(root) in mounts()
    second.release()
    assert list(root.iterdir()) == []
