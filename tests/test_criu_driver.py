"""The cpu driver with real CRIU on a small multi-process server (seconds, not minutes).

Covers what the engine cycle relies on: a process tree dumped and
restored twice from the same images (saved shared memory and link-remap
files put back each time), a fresh log per restore, and capture refusing
io_uring instances and connections to outside peers before anything is
written; and a TCP connection between two processes of the tree, dumped and restored.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
import requests
from registry_fixtures import free_port

from sparkrun_coldsnap.criu import tree_inspect
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.host.iouring import SYSCTL, io_uring_disabled
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids
from sparkrun_coldsnap.launch.local import start_unit

SERVER = Path(__file__).parent / "workloads" / "server.py"
FAKES = Path(__file__).parent / "fakes"


def wait_http(url: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return requests.get(url, timeout=2).text
        except requests.RequestException:
            time.sleep(0.05)
    raise AssertionError("%s did not answer" % url)


def start(tmp_path: Path, port: int, *extra: str):
    cmd = "%s %s --port %d %s" % (sys.executable, SERVER, port, " ".join(extra))
    unit = start_unit(cmd, env={"PATH": "/usr/bin:/bin"}, log_path=tmp_path / "server.log")
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "server.log").read_text():
        assert unit.alive() and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    return unit


def captured_server(tmp_path: Path, port: int, driver: CpuDriver):
    """The small server started, answering its first request, then checkpointed (it stops)."""
    with io_uring_disabled():
        unit = start(tmp_path, port)
        try:
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"
            image = driver.checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
        except BaseException:
            kill_tree(unit.root_pid)
            raise
    unit.reap()
    return image


def test_dump_then_restore_twice_from_the_same_images(criu, tmp_path):
    port = free_port()
    driver = CpuDriver()
    with io_uring_disabled():
        unit = start(tmp_path, port)
        try:
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"
            assert driver.precheck(unit.root_pid) == []
            image = driver.checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
        except BaseException:
            kill_tree(unit.root_pid)
            raise
    unit.reap()
    assert not unit.alive()
    assert not image.pid_namespace and len(image.pids) >= 3
    assert any(f.path.startswith("/dev/shm/psm_") for f in image.shared_files)
    assert not any(Path(f.path).exists() for f in image.shared_files)  # content moved into the images
    for attempt in (1, 2):
        assert driver.admission(image) == []  # the captured PIDs are free (zombies given time to be reaped)
        log = tmp_path / ("restore-%d.log" % attempt)
        pid = driver.restore(image, tmp_path / "images", log_path=log, progress=lambda m: None).root_pid
        try:
            # The counter lives in shared memory: it continues from the captured value.
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "3"
            assert "request" in log.read_text()  # output went to the fresh log
            assert len(tree_pids(pid)) >= 3
        finally:
            kill_tree(pid)


def test_capture_refuses_io_uring_and_outside_connections(tmp_path):
    if not SYSCTL.exists():
        pytest.fail("this kernel has no io_uring switch")
    old = SYSCTL.read_text().strip()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    SYSCTL.write_text("0")
    try:
        unit = start(tmp_path, free_port(), "--io-uring", "--connect", "127.0.0.1:%d" % listener.getsockname()[1])
    finally:
        SYSCTL.write_text(old)
    try:
        problems = CpuDriver().precheck(unit.root_pid)
        text = "; ".join(problems)
        assert "an io_uring instance" in text and "kernel.io_uring_disabled=2" in text
        assert "to a peer outside the workload" in text and "ESTABLISHED" in text
        assert all(("pid %d" % unit.root_pid) in p for p in problems)
        assert unit.alive()  # checking changed nothing
    finally:
        kill_tree(unit.root_pid)
        listener.close()


def test_closing_connections_are_waited_out_then_named(tmp_path):
    """A peer that hung up leaves the workload's end in CLOSE_WAIT: capture gives it a moment to
    close (a validation client that just finished does this), and names it if it stays."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with io_uring_disabled():
        unit = start(tmp_path, free_port(), "--connect", "127.0.0.1:%d" % listener.getsockname()[1])
    try:
        conn, _ = listener.accept()
        (established,) = tree_inspect.outside_connections(unit.root_pid)
        assert established[0].state == "ESTABLISHED"
        t = time.monotonic()
        assert tree_inspect.settled_outside_connections(unit.root_pid, settle=2.0)  # not closing: no wait
        assert time.monotonic() - t < 1.0
        conn.close()  # the workload never closes its end
        deadline = time.monotonic() + 5
        while tree_inspect.outside_connections(unit.root_pid)[0][0].state != "CLOSE_WAIT":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t = time.monotonic()
        (left,) = tree_inspect.settled_outside_connections(unit.root_pid, settle=1.0)
        assert left[0].state == "CLOSE_WAIT" and time.monotonic() - t >= 1.0
    finally:
        kill_tree(unit.root_pid)
        listener.close()


def test_a_connection_between_processes_of_the_tree_is_captured_and_restored(criu, tmp_path):
    """Both ends inside the tree: precheck allows it, the dump takes CRIU's established-TCP path,
    and the restored pair goes on talking over the same connection."""
    port = free_port()
    driver = CpuDriver()
    with io_uring_disabled():
        unit = start(tmp_path, port, "--inside-tcp")
        try:
            assert wait_http("http://127.0.0.1:%d/tcp" % port).strip() == "1"
            assert tree_inspect.established_inside(unit.root_pid)
            assert driver.precheck(unit.root_pid) == []
            image = driver.checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
        except BaseException:
            kill_tree(unit.root_pid)
            raise
    unit.reap()
    assert image.tcp_established
    assert driver.admission(image) == []
    pid = driver.restore(image, tmp_path / "images", log_path=tmp_path / "restore.log", progress=lambda m: None).root_pid
    try:
        assert wait_http("http://127.0.0.1:%d/tcp" % port).strip() == "2"  # the peer answered over the restored connection
    finally:
        kill_tree(pid)


def test_template_boundary_dump_resume_and_restore(criu, tmp_path):
    """The n580 mechanism, on a small server: pause after imports, dump, go on; restore, go on."""
    from sparkrun_coldsnap.drivers.n580 import N580Driver, template_command, wait_for_boundary

    port = free_port()
    cmd = template_command("%s -m server --port %d" % (sys.executable, port), module_for_script={}, preload=("json", "http.server"))
    assert "template_launcher.py server json,http.server --" in cmd
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SERVER.parent)}
    driver = N580Driver()
    with io_uring_disabled():
        unit = start_unit(cmd, env=env, log_path=tmp_path / "t.log")
        try:
            wait_for_boundary(tmp_path / "t.log", unit.alive, 30)
            assert driver.precheck(unit.root_pid) == []
            image = driver.checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
            assert unit.alive() and len(image.pids) == 1  # left running, nothing spawned yet
            driver.after_checkpoint(unit.root_pid)
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"
        finally:
            kill_tree(unit.root_pid)
            unit.reap()
    assert driver.admission(image) == []  # its PID is free again
    restored = driver.restore(image, tmp_path / "images", log_path=tmp_path / "r.log", progress=lambda m: None)
    try:
        assert restored.root_pid == image.root_pid  # host PID namespace: same PID
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"  # a fresh start past the boundary
    finally:
        kill_tree(restored.root_pid)


def test_template_carries_its_engine_caches_to_a_node_with_none(criu, tmp_path):
    """The n580 template with a FAKE engine that compiles after the boundary into the caches its
    environment names: the capture's engine compiles (miss), the caches travel as a layer, and
    the template restored where they were emptied finds them put back (hit); the one cache the
    recipe placed itself is not carried (miss again)."""
    import json
    import shutil

    from sparkrun_coldsnap.capsule import engine_caches
    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.drivers.n580 import N580Driver, template_command, wait_for_boundary
    from sparkrun_coldsnap.engines.vllm import VllmAdapter

    root, request, port = tmp_path / "engine-caches", "sha256:" + "7c" * 32, free_port()
    recipe_triton = tmp_path / "recipe-triton"
    caches = "VLLM_CACHE_ROOT,TORCHINDUCTOR_CACHE_DIR,TRITON_CACHE_DIR"
    cmd = template_command("%s -m fake_compiling_engine --port %d --caches %s" % (sys.executable, port, caches), module_for_script={}, preload=("json", "http.server", "hashlib"))
    driver = N580Driver()
    with settings_mod.using(settings_mod.current().replace(engine_cache_root=root)):
        base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(FAKES), "TRITON_CACHE_DIR": str(recipe_triton)}
        env, pointed = engine_caches.point(base, VllmAdapter.compile_caches, engine_caches.directory(request))
        with io_uring_disabled():
            unit = start_unit(cmd, env=env, log_path=tmp_path / "t.log")
            try:
                wait_for_boundary(tmp_path / "t.log", unit.alive, 30)
                image = driver.checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
                driver.after_checkpoint(unit.root_pid)
                assert json.loads(wait_http("http://127.0.0.1:%d/cache" % port)) == dict.fromkeys(caches.split(","), "miss")
            finally:
                kill_tree(unit.root_pid)
                unit.reap()
        store = CapsuleStore(tmp_path / "store").init()
        packed = engine_caches.pack(pointed, store.new_staging_dir("test-"))
        assert packed is not None
        layer, record = packed
        assert {c.name for c in record.caches if c.files} == {"vllm", "torchinductor"} and record.kept == ("TRITON_CACHE_DIR",)
        store.publish_blob_file(layer.path, layer.digest, layer.size)
        layers = [layer.descriptor()]
        assert engine_caches.problems(store, request, record, layers) == []
        shutil.rmtree(root)  # a node whose caches are empty, the recipe's own one too
        shutil.rmtree(recipe_triton)
        assert engine_caches.install(store, request, record, layers)["files_written"] == record.files == 2
        assert driver.admission(image) == []
        restored = driver.restore(image, tmp_path / "images", log_path=tmp_path / "r.log", progress=lambda m: None)
        try:
            found = json.loads(wait_http("http://127.0.0.1:%d/cache" % port))
            assert found == {"VLLM_CACHE_ROOT": "hit", "TORCHINDUCTOR_CACHE_DIR": "hit", "TRITON_CACHE_DIR": "miss"}
        finally:
            kill_tree(restored.root_pid)
        blob = store.blob_path(layer.digest)
        blob.chmod(0o644)
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        assert "damaged" in engine_caches.problems(store, request, record, layers)[0]


def host_pid_namespace_pid(pid: int) -> list[int]:
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError("no NSpid for %d" % pid)


def test_one_capture_restores_twice_at_once_each_on_its_own_port(criu, tmp_path):
    port = free_port()
    driver = CpuDriver()
    image = captured_server(tmp_path, port, driver)
    # Segment and semaphore names are random; CRIU's link_remap.N names are not (other dumps reuse them).
    shm_names = {f.path for f in image.shared_files if not Path(f.path).name.startswith("link_remap.")}
    assert image.listening_ports == (port,)
    ports = (free_port(), free_port())
    roots = []
    try:
        for p in ports:
            roots.append(driver.restore(image, tmp_path / "images", log_path=tmp_path / ("r-%d.log" % p), progress=lambda m: None, port=p).root_pid)
        for p, root in zip(ports, roots):
            # Each came back with the captured root PID, inside a PID namespace of its own,
            # its shared memory in a /dev/shm of its own, and serves on the port it was given.
            assert host_pid_namespace_pid(root)[-1] == image.root_pid and root != image.root_pid
            assert wait_http("http://127.0.0.1:%d/state" % p).strip() == "2"
        assert [path for path in shm_names if Path(path).exists()] == []  # nothing written to the host's /dev/shm
        assert wait_http("http://127.0.0.1:%d/state" % ports[0]).strip() == "3"  # they count apart
        assert wait_http("http://127.0.0.1:%d/state" % ports[1]).strip() == "3"
        with pytest.raises(requests.RequestException):
            requests.get("http://127.0.0.1:%d/state" % port, timeout=2)  # the captured port stays inside
    finally:
        for root in roots:
            kill_tree(root)
    keepers_gone = time.monotonic() + 10
    while any(socket_open(p) for p in ports):
        assert time.monotonic() < keepers_gone, "a port forwarder outlived its tree"
        time.sleep(0.05)


def socket_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
