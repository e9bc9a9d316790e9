"""The pieces of a restore into a new container that need no capsule: the checkpoint made of
links, containerd's unpacked copy of it, the runtime that asks runc for memory on demand,
and preparation's refusals, which leave no container behind (real docker for those)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sparkrun_coldsnap.errors import RestoreError, ToolError
from sparkrun_coldsnap.host import disk_room
from sparkrun_coldsnap.launch import checkpoint_leftovers, checkpoint_links, container_restore, lazy_runtime, volume_files
from sparkrun_coldsnap.launch import docker as docker_unit

IMAGE = "coldsnap/vllm-cpu:0.32.0"


def staged(tmp_path: Path) -> Path:
    """What preparation unpacks: CRIU's images, runc's descriptors, the plugin's own files."""
    images = tmp_path / "staging" / "restore-abc" / "units" / "solo"
    images.mkdir(parents=True)
    for name, data in (("inventory.img", b"inv"), ("pstree.img", b"tree-42"), ("pages-1.img", b"\1" * 8192), ("descriptors.json", b"[]")):
        (images / name).write_bytes(data)
    (images / "dump.log").write_text("criu's log of the dump\n")
    layer = tmp_path / "layer"
    (layer / "tmp").mkdir(parents=True)
    (layer / "tmp" / "sparkrun_serve.log").write_text("the engine's log\n")
    docker_unit.write_rootfs_tar(layer, images / docker_unit.ROOTFS_TAR)
    return images


def test_a_checkpoint_of_links_reads_the_staged_images_in_place(tmp_path):
    images = staged(tmp_path)
    home = checkpoint_links.own_images(images, checkpoint_links.home_for(images, "coldsnap-restore-x"))
    assert home == tmp_path / "staging" / "coldsnap-restore-x.images" and not images.exists()
    checkpoint = tmp_path / "docker" / "checkpoints" / "coldsnap"
    assert checkpoint_links.link_images(home, checkpoint, lazy=True) == 4
    names = sorted(os.listdir(checkpoint))
    # CRIU's images and runc's descriptors; not the writable layer, not the dump's log.
    assert names == ["descriptors.json", "inventory.img", "lazy-pages.socket", "pages-1.img", "pstree.img"]
    # Relative links that climb to the root first: the restored processes, whose root is the
    # container's, open some images through them (an absolute link would resolve in there).
    assert all(os.readlink(checkpoint / n).startswith("../" * 64) for n in names)
    assert (checkpoint / "pages-1.img").read_bytes() == b"\1" * 8192
    assert checkpoint_links.linked_path(os.readlink(checkpoint / "lazy-pages.socket")) == home / "lazy-pages.socket"
    copy = tmp_path / "deep" / "er" / "ctrd-checkpoint1"  # containerd unpacks elsewhere, at any depth
    copy.parent.mkdir(parents=True)
    shutil.copytree(checkpoint, copy, symlinks=True)
    assert (copy / "pages-1.img").read_bytes() == b"\1" * 8192


def test_containerds_unpacked_copy_of_links_is_removed_even_after_the_images_are_gone(tmp_path):
    images = staged(tmp_path)
    temp = tmp_path / "tmp"
    ours = temp / "ctrd-checkpoint111"
    checkpoint_links.link_images(images, ours, lazy=False)
    (ours / "restore.log").write_text("criu's log of the restore\n")
    other = temp / "ctrd-checkpoint222"  # another restore's links, maybe in use
    other_images = staged(tmp_path / "other")
    checkpoint_links.link_images(other_images, other, lazy=False)
    shutil.rmtree(images)  # memory on demand removes the images once every page is delivered
    assert checkpoint_leftovers.remove_unpacked_copies(images, {temp}) == [ours]
    assert not ours.exists() and other.exists() and (other_images / "pages-1.img").exists()


def test_removing_a_copy_of_links_never_touches_what_they_point_to(tmp_path):
    images = staged(tmp_path)
    temp = tmp_path / "tmp"
    checkpoint_links.link_images(images, temp / "ctrd-checkpoint1", lazy=False)
    checkpoint_leftovers.remove_unpacked_copies(images, {temp})
    assert sorted(p.name for p in images.iterdir()) == sorted(["inventory.img", "pstree.img", "pages-1.img", "descriptors.json", "dump.log", docker_unit.ROOTFS_TAR])
    assert (images / "pages-1.img").read_bytes() == b"\1" * 8192


def run_wrapper(tmp_path: Path, *args: str, runc_exit: int = 0, show_config: bool = False) -> tuple[int, list[str]]:
    """The runtime's script in front of a fake runc that prints the arguments it got (and, with
    *show_config*, the CRIU configuration file its environment names, last)."""
    fake_runc = tmp_path / "fake-runc"
    show = 'echo "config=${CRIU_CONFIG_FILE-unset}"\n' if show_config else ""
    fake_runc.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n%sexit %d\n' % (show, runc_exit))
    fake_runc.chmod(0o755)
    wrapper = tmp_path / "wrapper"
    wrapper.write_text(lazy_runtime.script(str(fake_runc)))
    wrapper.chmod(0o755)
    cp = subprocess.run([str(wrapper), *args], capture_output=True, text=True)
    return cp.returncode, cp.stdout.splitlines()


def test_the_runtime_asks_runc_for_memory_on_demand_only_for_a_checkpoint_with_a_live_socket(tmp_path):
    checkpoint, work, images = tmp_path / "ctrd-checkpoint1", tmp_path / "bundle" / "work", tmp_path / "images"
    checkpoint.mkdir()
    images.mkdir()
    restore = ["--root", "/run/docker/runtime-coldsnap-runc/moby", "--log", "/l.json", "restore", "--image-path", str(checkpoint), "--work-path", str(work)]
    restore += ["--detach", "--pid-file", "/p", "-no-subreaper", "--bundle", "/b c", "id"]
    assert run_wrapper(tmp_path, *restore) == (0, restore)  # no socket: runc's ordinary restore
    assert not work.exists()
    with socket.socket(socket.AF_UNIX) as sk:
        sk.bind(str(images / "lazy-pages.socket"))
        sk.listen(1)
        (checkpoint / "lazy-pages.socket").symlink_to(checkpoint_links.link_target(images / "lazy-pages.socket"))
        assert run_wrapper(tmp_path, *restore) == (0, restore[:5] + ["--lazy-pages"] + restore[5:])
        # CRIU looks for the daemon in its work directory, where containerd's shim points runc.
        assert os.readlink(work / "lazy-pages.socket") == str(images / "lazy-pages.socket")
        for argv in (["--root", "/r", "state", "id"], ["--root", "/r", "checkpoint", "--image-path", str(checkpoint), "id"]):
            assert run_wrapper(tmp_path, *argv) == (0, argv)
        # A failed restore keeps CRIU's log beside the images: containerd removes the work directory.
        (work / "restore.log").write_text("(00.1) Error (criu/uffd.c:123): lazy-pages: connect failed\n")
        rc, _ = run_wrapper(tmp_path, *restore, runc_exit=1)
        assert rc == 1 and (images / "restore.log").read_text().startswith("(00.1) Error")


def test_the_runtime_has_crius_tree_left_stopped_only_for_a_restore_whose_checkpoint_asks(tmp_path):
    checkpoint, images = tmp_path / "ctrd-checkpoint1", tmp_path / "images"
    checkpoint.mkdir()
    images.mkdir()
    restore = ["--root", "/r", "restore", "--image-path", str(checkpoint), "--work-path", str(tmp_path / "work"), "--detach", "--bundle", "/b", "id"]
    # No request: runc's ordinary restore, its arguments and its environment untouched.
    assert run_wrapper(tmp_path, *restore, show_config=True) == (0, restore + ["config=unset"])
    checkpoint_links.ask_leave_stopped(images)
    assert (images / checkpoint_links.LEAVE_STOPPED).read_text().split() == ["leave-stopped"]
    (checkpoint / checkpoint_links.LEAVE_STOPPED).symlink_to(checkpoint_links.link_target(images / checkpoint_links.LEAVE_STOPPED))
    # Asked: the same arguments, and criu swrk (started with runc's environment) reads the file.
    assert run_wrapper(tmp_path, *restore, show_config=True) == (0, restore + ["config=%s" % (images / checkpoint_links.LEAVE_STOPPED)])
    # Only a restore: a checkpoint of the same directory, or any other call, goes through as it is.
    for argv in (["--root", "/r", "checkpoint", "--image-path", str(checkpoint), "id"], ["--root", "/r", "state", "id"]):
        assert run_wrapper(tmp_path, *argv, show_config=True) == (0, argv + ["config=unset"])
    assert run_wrapper(tmp_path, *restore, runc_exit=3, show_config=True)[0] == 3


def test_the_runtime_is_used_only_where_the_daemon_knows_it(tmp_path, monkeypatch):
    monkeypatch.setattr(lazy_runtime, "WRAPPER", tmp_path / "absent")
    assert not lazy_runtime.installed("coldsnap-runc,runc")
    monkeypatch.setattr(lazy_runtime, "WRAPPER", Path(__file__))
    assert lazy_runtime.installed("coldsnap-runc,runc") and not lazy_runtime.installed("runc")
    assert not lazy_runtime.leaves_stopped("coldsnap-runc,runc")  # a wrapper written before it could
    newer = tmp_path / "coldsnap-runc"
    newer.write_text(lazy_runtime.script("/usr/sbin/runc"))
    monkeypatch.setattr(lazy_runtime, "WRAPPER", newer)
    assert lazy_runtime.leaves_stopped("coldsnap-runc,runc") and not lazy_runtime.leaves_stopped("runc")


# -- with the real daemon ------------------------------------------------------------------


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def daemon(docker_daemon):
    if not shutil.which("docker") or docker("info").returncode != 0 or docker("image", "inspect", IMAGE).returncode != 0:
        pytest.fail("no docker daemon with %s: run `sparkrun coldsnap setup --docker`" % IMAGE)
    image_id = docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    return docker_unit.ContainerSpec(image=image_id, command="sleep 1", env={}, volumes={})


def named(name: str) -> list[str]:
    return docker("ps", "-a", "--filter", "name=^%s$" % name, "--format", "{{.Names}}").stdout.split()


def test_no_room_under_dockers_root_is_refused_before_a_container_is_made(daemon, tmp_path, monkeypatch):
    images = staged(tmp_path)
    root = Path(docker_unit.info()["root_dir"])
    real = disk_room.free_bytes
    monkeypatch.setattr(disk_room, "free_bytes", lambda p: 100 << 20 if Path(p) == root else real(p))
    with pytest.raises(RestoreError) as err:
        container_restore.prepare_restore(daemon, images, "coldsnap-test-room-1")
    assert "\n" not in str(err.value) and "not enough disk space under docker's root %s" % root in str(err.value)
    assert named("coldsnap-test-room-1") == [] and images.exists()


def test_a_writable_layer_docker_cannot_load_leaves_no_container(daemon, tmp_path):
    images = staged(tmp_path)
    (images / docker_unit.ROOTFS_TAR).write_bytes(b"this is not a tar archive" * 100)
    with pytest.raises(RestoreError, match="loading the captured writable layer into the new container failed"):
        container_restore.prepare_restore(daemon, images, "coldsnap-test-layer-1")
    assert named("coldsnap-test-layer-1") == []
    assert images.exists() and not checkpoint_links.home_for(images, "coldsnap-test-layer-1").exists()


def test_an_image_that_is_not_here_is_one_line(daemon, tmp_path):
    images = staged(tmp_path)
    missing = docker_unit.ContainerSpec(image="sha256:" + "0" * 64, command="sleep 1", env={}, volumes={})
    with pytest.raises(RestoreError) as err:
        container_restore.prepare_restore(missing, images, "coldsnap-test-image-1")
    assert "\n" not in str(err.value) and "creating the container for the restore failed" in str(err.value)
    assert named("coldsnap-test-image-1") == []


def test_a_name_held_by_another_container_is_not_taken(daemon, tmp_path):
    holder = docker("create", "--name", "coldsnap-test-holder", IMAGE, "true")
    assert holder.returncode == 0, holder.stderr
    try:
        prepared = container_restore.prepare_restore(daemon, staged(tmp_path), "coldsnap-test-prepared-1", lazy=False)
        images = prepared.images
        try:
            with pytest.raises(RestoreError) as err:
                container_restore.start_from_checkpoint(prepared, "coldsnap-test-holder")
            assert "\n" not in str(err.value)
            assert "a container named coldsnap-test-holder already exists (%s)" % holder.stdout.strip()[:12] in str(err.value)
        finally:
            prepared.remove()  # what the controller's discard does
        assert named("coldsnap-test-prepared-1") == [] and not images.exists()
        assert named("coldsnap-test-holder") == ["coldsnap-test-holder"]  # untouched
    finally:
        docker("rm", "-f", "coldsnap-test-holder")


def test_a_tcp_connection_inside_the_container_is_checkpointed_with_both_ends(daemon, tmp_path):
    # What torch.distributed's store keeps open in every GPU engine: a TCP connection from the
    # tree to itself. runc's CRIU refuses it unless runc.conf says tcp-established.
    assert docker_unit.missing_runc_options() == [], "run `sparkrun coldsnap setup --docker`"
    command = 'python3 -c \'import socket, time; s = socket.create_server(("127.0.0.1", 0)); c = socket.create_connection(s.getsockname()); a, _ = s.accept(); c.sendall(b"x"); print("connected", flush=True); time.sleep(600)\''
    spec = dataclasses.replace(daemon, command=command)
    unit = docker_unit.start_container(spec, "coldsnap-test-tcp")
    try:
        for _ in range(100):
            if "connected" in docker("exec", unit.container_id, "cat", docker_unit.LOG_IN_CONTAINER).stdout:
                break
            time.sleep(0.1)
        images = tmp_path / "images"
        docker_unit.checkpoint(unit, images)
        assert any(p.name.startswith("tcp-stream-") for p in images.iterdir()), sorted(p.name for p in images.iterdir())
    finally:
        unit.remove()
    assert named("coldsnap-test-tcp") == []


def test_a_failed_checkpoint_keeps_crius_log_and_names_it(daemon, tmp_path, monkeypatch):
    # An io_uring instance: CRIU cannot dump one, so runc's checkpoint fails. containerd
    # removes CRIU's log with the task once the container goes: the failure keeps a copy.
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    if Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() != "0":
        pytest.fail("io_uring is disabled on this host (kernel.io_uring_disabled): set it to 0 for this test")
    command = "python3 -c 'import ctypes, time; fd = ctypes.CDLL(None, use_errno=True).syscall(425, 4, ctypes.create_string_buffer(120)); print(\"ring\", fd, flush=True); time.sleep(600)'"
    unit = docker_unit.start_container(dataclasses.replace(daemon, command=command), "coldsnap-test-ring")
    try:
        for _ in range(100):
            if "ring" in docker("exec", unit.container_id, "cat", docker_unit.LOG_IN_CONTAINER).stdout:
                break
            time.sleep(0.1)
        assert "ring -1" not in docker("exec", unit.container_id, "cat", docker_unit.LOG_IN_CONTAINER).stdout
        with pytest.raises(ToolError) as failed:
            docker_unit.checkpoint(unit, tmp_path / "images")
    finally:
        unit.remove()
    kept = tmp_path / "home" / "run" / "logs" / "container-checkpoint-coldsnap-test-ring.log"
    assert "; CRIU's log: %s (" % kept in str(failed.value), str(failed.value)
    assert "Dumping FAILED" in kept.read_text()
    assert named("coldsnap-test-ring") == []


#: A process holding 64 MiB of random bytes and their hash; each time a request file appears
#: in the bound /probe, it hashes its memory again and writes what it found.
HOLDER = """
import hashlib, os, time
data = bytearray(os.urandom(64 << 20))
digest = hashlib.sha256(data).hexdigest()
open("/probe/ready", "w").write(digest)
while True:
    if os.path.exists("/probe/ask"):
        os.unlink("/probe/ask")
        found = hashlib.sha256(data).hexdigest()
        open("/probe/answer.tmp", "w").write("match" if found == digest else "mismatch " + found)
        os.rename("/probe/answer.tmp", "/probe/answer")
    time.sleep(0.05)
"""


def ask_holder(probe: Path, timeout: float = 60.0) -> str:
    (probe / "answer").unlink(missing_ok=True)
    (probe / "ask").write_text("")
    deadline = time.monotonic() + timeout
    while not (probe / "answer").exists():
        assert time.monotonic() < deadline, "the process in the container did not answer"
        time.sleep(0.05)
    return (probe / "answer").read_text()


def test_a_container_restore_with_a_page_fill_brings_every_byte_back(daemon, tmp_path, use_settings):
    # The big area leaves CRIU's images (CRIU restores it as zeros), the runtime has CRIU leave
    # the tree stopped, the fill writes it, then the tree goes on: the hash matches only if the
    # fill wrote every byte.
    from sparkrun_coldsnap.setup import docker_install

    use_settings(page_fill_threads=2)
    assert lazy_runtime.installed(docker_unit.info()["runtimes"]), "run `sparkrun coldsnap setup --docker`"
    # The runtime's wrapper as this code writes it (setup run from an older checkout leaves its own).
    docker_install.lazy_runtime_installed(lambda _line: None)
    assert lazy_runtime.leaves_stopped(docker_unit.info()["runtimes"])
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "holder.py").write_text(HOLDER)
    spec = dataclasses.replace(daemon, command="python3 /probe/holder.py", volumes={str(probe): "/probe"})
    unit = docker_unit.start_container(spec, "coldsnap-test-fill")
    try:
        deadline = time.monotonic() + 60
        while not (probe / "ready").exists():
            assert time.monotonic() < deadline and unit.alive(), docker("logs", unit.container_id).stderr
            time.sleep(0.1)
        assert ask_holder(probe) == "match"
        images = tmp_path / "staging" / "restore-fill" / "units" / "solo"
        docker_unit.checkpoint(unit, images)
        unit.remove()
        prepared = container_restore.prepare_restore(spec, images, "coldsnap-test-fill-restore-1", lazy=False)
        assert prepared.fill and prepared.fill_split is not None and prepared.fill_split["bytes_moved"] >= 64 << 20, prepared.fill_split
        home = prepared.images
        assert (home / checkpoint_links.LEAVE_STOPPED).exists()
        try:
            restored = container_restore.start_from_checkpoint(prepared, "coldsnap-test-fill")
        except BaseException:
            prepared.remove()
            raise
        try:
            assert restored.page_fill is not None and restored.page_fill["bytes"] >= 64 << 20 and restored.page_fill["threads"] >= 1, restored.page_fill
            assert {"docker_start_checkpoint", "page_fill", "continue"} <= set(restored.steps), restored.steps
            assert ask_holder(probe) == "match"
        finally:
            restored.remove()
    finally:
        unit.remove()
    assert named("coldsnap-test-fill") == [] and named("coldsnap-test-fill-restore-1") == []


def test_images_split_for_a_fill_are_refused_before_a_container_is_made_where_the_runtime_cannot_leave_the_tree_stopped(daemon, tmp_path, monkeypatch):
    images = staged(tmp_path)
    (images / "fill-1.json").write_text('{"pid": 1, "data": "fill-1.pages", "bytes": 8192, "runs": [[4096, 8192, 0]]}')
    monkeypatch.setattr(lazy_runtime, "WRAPPER", tmp_path / "absent")
    with pytest.raises(RestoreError) as err:
        container_restore.prepare_restore(daemon, images, "coldsnap-test-split-1", lazy=False)
    assert "\n" not in str(err.value) and "were split for a memory fill" in str(err.value) and "setup --docker" in str(err.value)
    assert named("coldsnap-test-split-1") == [] and (images / "fill-1.json").exists()


def test_a_stale_preparation_is_removed_with_its_images(daemon, tmp_path):
    prepared = container_restore.prepare_restore(daemon, staged(tmp_path), "coldsnap-test-stale-aaaa1111", lazy=False)
    assert prepared.images.exists()
    docker_unit.remove_stale("coldsnap-test-stale-")
    assert named("coldsnap-test-stale-aaaa1111") == [] and not prepared.images.exists()


# -- the compile-cache files the processes map -------------------------------------------------


def container_root(tmp_path: Path) -> Path:
    """A container's root as the host sees it, with two kernels compiled into the cache."""
    root = tmp_path / "root"
    kernels = root / "cache" / "runtime" / "vllm" / "inductor"
    kernels.mkdir(parents=True)
    (kernels / "a.so").write_bytes(b"kernel a")
    (kernels / "b.so").write_bytes(b"kernel b")
    return root


def test_only_the_cache_files_in_use_are_kept():
    mapped = [
        "/cache/runtime/vllm/inductor/a.so",
        "/cache/runtime/vllm/inductor/old.so (deleted)",  # CRIU keeps a deleted file itself
        "/cache/huggingface/hub/model.safetensors",  # the weights: recorded and verified apart
        "/opt/engine/lib/libtorch.so",  # in the image, pinned by its digest
        "/cache/runtime/vllm/inductor/a.so",
    ]
    assert volume_files.cache_paths(mapped) == ["/cache/runtime/vllm/inductor/a.so"]


def test_the_cache_files_the_processes_map_travel_with_the_capsule_and_come_back_where_missing(tmp_path):
    images = tmp_path / "images"
    files = ["/cache/runtime/vllm/inductor/a.so", "/cache/runtime/vllm/inductor/b.so"]
    assert volume_files.save(files, container_root(tmp_path), images) == 2
    host_cache = tmp_path / "host-cache"  # another host's (or home's) cache: empty
    volumes = {str(host_cache): "/cache/runtime", "/hf": "/cache/huggingface"}
    assert volume_files.put_back(images, volumes) == 2
    assert (host_cache / "vllm" / "inductor" / "a.so").read_bytes() == b"kernel a"
    assert volume_files.put_back(images, volumes) == 0  # already there, same content
    (host_cache / "vllm" / "inductor" / "b.so").write_bytes(b"recompiled")
    with pytest.raises(RestoreError, match=r"b.so differs from the file the captured processes mapped"):
        volume_files.put_back(images, volumes)
    with pytest.raises(RestoreError, match="mounts nothing there"):
        volume_files.put_back(images, {"/hf": "/cache/huggingface"})


def test_a_container_restored_from_its_checkpoint_reads_a_copy_made_after_it_in_the_shared_weights_tmpfs(daemon, tmp_path, use_settings, monkeypatch):
    # What native weights in a container rest on: the payload's directories bound at capture,
    # CRIU restoring the container into the same binds, and a copy into memory made after the
    # checkpoint (in preparation) visible to the restored processes at the path they are handed.
    from sparkrun_coldsnap.weights import container_mounts, weights_memory

    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    use_settings(home=tmp_path / "home")
    spec = dataclasses.replace(daemon, command="sleep 600", weights_volumes=container_mounts.for_capture())
    unit = docker_unit.start_container(spec, "coldsnap-test-weights")
    copy = None
    try:
        images = tmp_path / "staging" / "restore-weights" / "units" / "solo"
        docker_unit.checkpoint(unit, images)
        unit.remove()
        payload = tmp_path / "payload"
        payload.mkdir()
        (payload / "rank-0.bin").write_bytes(os.urandom(1 << 20))
        copy = weights_memory.copy_into_memory([payload / "rank-0.bin"], shared=True)
        prepared = container_restore.prepare_restore(spec, images, "coldsnap-test-weights-restore-1", lazy=False)
        try:
            restored = container_restore.start_from_checkpoint(prepared, "coldsnap-test-weights")
        except BaseException:
            prepared.remove()
            raise
        try:
            seen = subprocess.run(["docker", "exec", restored.container_id, "cat", str(copy.directory / "rank-0.bin")], capture_output=True, timeout=60)
            assert seen.returncode == 0 and seen.stdout == (payload / "rank-0.bin").read_bytes(), seen.stderr
            engine_side = container_mounts.for_capture()["engine_side"]
            assert docker("exec", restored.container_id, "ls", engine_side + "/coldsnap_worker.py").returncode == 0
            assert docker("exec", restored.container_id, "touch", engine_side + "/x").returncode != 0  # read only
        finally:
            restored.remove()
    finally:
        unit.remove()
        if copy is not None:
            copy.release()
        subprocess.run(["umount", "-l", str(container_mounts.shared_root())], capture_output=True)
    assert named("coldsnap-test-weights") == [] and named("coldsnap-test-weights-restore-1") == []
