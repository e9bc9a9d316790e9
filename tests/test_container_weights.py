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


def test_a_containers_engine_finds_the_images_packages_beside_the_adapters_extension(monkeypatch):
    """``-e PYTHONPATH=`` replaces what the image sets: an image keeping vLLM on PYTHONPATH
    (/opt/engine-site) started an engine that could not import vllm once the worker
    extension's directory was put there alone."""
    from sparkrun_coldsnap.engines.vllm import VllmAdapter
    from sparkrun_coldsnap.launch import docker

    asked = []
    monkeypatch.setattr(docker, "image_env", lambda image: asked.append(image) or {"PATH": "/usr/bin", "PYTHONPATH": "/opt/engine-site"})
    monkeypatch.setattr(containers, "unit_gpus", lambda workload: ())  # no GPU here: no device entries
    workload = gpu_container_workload()
    command, env = VllmAdapter().prepare_launch("vllm serve /m", containers.Containers().engine_env(workload, None, {}), release_weights=True, native_weights=True)
    spec = containers.container_spec(workload, command, env)
    assert asked == ["sha256:" + "a" * 64] and spec.env["PYTHONPATH"] == "%s:/opt/engine-site" % ENGINE_SIDE_DIR and "PATH" not in spec.env
    # Nothing put on PYTHONPATH: the image's stays the image's, nothing asked.
    assert "PYTHONPATH" not in containers.container_spec(workload, "vllm serve /m", {}).env and len(asked) == 1
    # A recipe that sets PYTHONPATH itself decides, as docker would let it.
    own = workload.model_copy(update={"launch": workload.launch.model_copy(update={"env": {"PYTHONPATH": "/mine"}})})
    _, env = VllmAdapter().prepare_launch("vllm serve /m", containers.Containers().engine_env(own, None, {}), release_weights=True, native_weights=True)
    assert containers.container_spec(own, "vllm serve /m", env).env["PYTHONPATH"] == "%s:/mine" % ENGINE_SIDE_DIR and len(asked) == 1


def test_image_env_reads_the_environment_an_image_sets(docker_daemon, tmp_path):
    import subprocess

    from sparkrun_coldsnap.launch import docker

    (tmp_path / "root" / "opt" / "engine-site").mkdir(parents=True)
    tar = subprocess.Popen(["tar", "-C", str(tmp_path / "root"), "-c", "."], stdout=subprocess.PIPE)
    made = subprocess.run(["docker", "import", "--change", "ENV PYTHONPATH=/opt/engine-site", "-", "coldsnap-test/image-env:1"], stdin=tar.stdout, capture_output=True, text=True)
    tar.wait()
    assert made.returncode == 0, made.stderr
    try:
        assert docker.image_env(made.stdout.strip())["PYTHONPATH"] == "/opt/engine-site"
        assert docker.image_env("coldsnap-test/not-here:1") == {}
    finally:
        subprocess.run(["docker", "image", "rm", "-f", "coldsnap-test/image-env:1"], capture_output=True)


def test_a_gpu_containers_binds_include_the_drivers_files(monkeypatch):
    """runc makes a mount point for every bind in the container's writable layer, the driver's
    files included; the captured layer must leave each of them out."""
    from sparkrun_coldsnap.launch import gpu_devices

    monkeypatch.setattr(gpu_devices, "device_args", lambda gpus: ["--device", "/dev/nvidia0", "-v", "/lib/libcuda.so.1:/lib/libcuda.so.1:ro"])
    spec = ContainerSpec(image="sha256:" + "b" * 64, command="x", env={}, volumes={"/srv/hf": "/cache/huggingface"}, gpus=("0",),
                         weights_volumes={"native": "/home/x/native"})  # fmt: skip
    assert sorted(spec.bind_targets()) == ["/cache/huggingface", "/home/x/native", "/lib/libcuda.so.1"]


def test_the_captured_layer_leaves_out_mount_points_reached_through_the_images_links(tmp_path):
    """A bind at /lib/libcuda.so in an image whose /lib links to usr/lib has its mount point at
    usr/lib/libcuda.so in the writable layer; loading that into the restored container failed
    with "unlinkat /usr/lib/libcuda.so: device or resource busy"."""
    import tarfile

    from sparkrun_coldsnap.launch import docker

    image = tmp_path / "image"
    (image / "usr" / "lib").mkdir(parents=True)
    (image / "lib").symlink_to("usr/lib")
    (image / "opt").mkdir()
    (image / "opt" / "site").symlink_to("/usr/lib/site")  # an absolute link, read inside the image
    upper = tmp_path / "upper"
    for name in ("usr/lib/libcuda.so", "usr/lib/site/ext.py", "usr/local/nvidia/lib64/libcuda.so", "root/.cache/kept.txt"):
        (upper / name).parent.mkdir(parents=True, exist_ok=True)
        (upper / name).write_text("")
    assert docker.resolve_in_layers("/lib/libcuda.so", [upper, image]) == "usr/lib/libcuda.so"
    assert docker.resolve_in_layers("/opt/site/ext.py", [upper, image]) == "usr/lib/site/ext.py"
    assert docker.resolve_in_layers("/lib", [upper, image]) == "lib"  # the last name is the mount point itself
    target = tmp_path / "layer.tar"
    docker.write_rootfs_tar(upper, target, mount_points=["/lib/libcuda.so:ro", "/opt/site/ext.py", "/usr/local/nvidia/lib64/libcuda.so"], layers=[upper, image])
    with tarfile.open(target) as tar:
        files = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert files == ["root/.cache/kept.txt"]
