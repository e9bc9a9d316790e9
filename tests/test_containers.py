"""The container path with real Docker: capture a CPU vLLM server running in a container,
restore it into a NEW container through `sparkrun run`, validate, and let sparkrun and docker
treat it as any other container; then the faults: a name already taken, a capsule of another
image, the docker daemon restarting in the middle of a restore. Each leaves no container, no
copy of the images and no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import BIN, RECIPE, Sparkrun, base_env, require_engine, write_recipe

from sparkrun_coldsnap.host import paths, xstate_perm
from sparkrun_coldsnap.launch import checkpoint_leftovers, lazy_runtime

pytestmark = pytest.mark.engine
DOCKER_RECIPE = RECIPE.with_name("tiny-vllm-cpu-docker.yaml")
PROMPT = "Reply with one short sentence: what is a cold start?"
IMAGE = "coldsnap/vllm-cpu:0.32.0"


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


def require_docker() -> None:
    if not shutil.which("docker") or docker("info").returncode != 0:
        pytest.fail("no docker daemon: run `sparkrun coldsnap setup --docker` (scripts/test.sh does)")
    if docker("image", "inspect", IMAGE).returncode != 0:
        pytest.fail("no engine image %s: run `sparkrun coldsnap setup --docker`" % IMAGE)


def containers() -> list[dict]:
    out = docker("ps", "-a", "--format", "{{json .}}").stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def unpacked_checkpoints() -> set:
    """containerd's ``ctrd-checkpoint*`` directories on this host."""
    return {d for parent in checkpoint_leftovers.containerd_temp_dirs() for d in parent.glob(checkpoint_leftovers.PREFIX + "*")}


def staged_images() -> list[Path]:
    """Images staged for a restore, wherever preparation put them (tmpfs, or beside the store)."""
    roots = [paths.memory_staging(0) or Path("/nonexistent")]
    return [p for root in roots if root.is_dir() for p in root.iterdir()]


def lazy_daemons() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "lazy-pages" in cmd and "coldsnap-staging" in cmd:
            found.append(p)
    return found


def in_docker_cgroups() -> list[int]:
    """Processes inside any docker container's cgroup (none should be, with no container)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if "/docker/" in Path("/proc/%s/cgroup" % entry).read_text():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def assert_nothing_left(unpacked_before: set, timeout: float = 20.0) -> None:
    """No container, no images, no unpacked copy, no lazy-pages daemon, no process in a container.

    The lazy-pages daemon removes the images once it has delivered every page or its
    processes are gone, and docker removes a ``--rm`` container just after it stops: a few
    seconds after a stop.
    """
    deadline = time.monotonic() + timeout
    while staged_images() or lazy_daemons() or containers():
        assert time.monotonic() < deadline, "left behind: %s %s %s" % (staged_images(), lazy_daemons(), containers())
        time.sleep(0.2)
    assert unpacked_checkpoints() <= unpacked_before
    assert in_docker_cgroups() == []


def containerd_left() -> set[str]:
    """containerd's containers and tasks in docker's namespace, and the shims that run tasks: a task
    docker lost sight of (state CREATED, its shim running) is invisible to ``docker ps -a``."""
    found: set[str] = set()
    for sock in ("/var/run/docker/containerd/containerd.sock", "/run/containerd/containerd.sock"):
        if not os.path.exists(sock):
            continue
        for what in ("containers", "tasks"):
            cp = subprocess.run(["ctr", "-a", sock, "-n", "moby", what, "ls"], capture_output=True, text=True, timeout=60)
            assert cp.returncode == 0, cp.stderr
            found.update("%s %s" % (what, line.split()[0]) for line in cp.stdout.splitlines()[1:] if line.strip())
    for p in psutil.process_iter(["name", "cmdline"]):
        if (p.info["name"] or "").startswith("containerd-shim"):
            found.add("shim %s" % " ".join(p.info["cmdline"] or []))
    return found


def ask() -> str:
    body = {"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0, "seed": 0}
    r = requests.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def docker_recipe(tmp_path: Path, store: Path, *, name: str = "tiny-docker.yaml", replace: dict[str, str] | None = None) -> Path:
    block = "coldsnap:\n  capsule:\n    name: tiny-docker\n    store: %s\n  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, PROMPT)
    return write_recipe(tmp_path, coldsnap=block, name=name, source=DOCKER_RECIPE, replace=replace)


def error_lines(cp: subprocess.CompletedProcess) -> list[str]:
    return [l for l in (cp.stderr + cp.stdout).splitlines() if l.startswith("Error:")]


@pytest.fixture(scope="module")
def captured(tmp_path_factory, template_home):
    """One real capture in a container for the module: (store, recipe, receipt)."""
    require_engine()
    require_docker()
    assert not [c for c in containers() if "coldsnap" in c["Names"] or c["Names"].startswith("sparkrun_")], containers()
    tmp = tmp_path_factory.mktemp("docker-captured")
    home = tmp / "home"
    shutil.copytree(template_home, home, symlinks=True)
    sr = Sparkrun(home, base_env(home))
    store = tmp / "store"
    recipe = docker_recipe(tmp, store)
    receipt_path = tmp / "capture.json"
    sr.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(receipt_path))
    assert containers() == []  # the capture container is gone; its state is in the capsule
    return store, recipe, json.loads(receipt_path.read_text())


def test_capture_in_a_container_restore_into_a_new_one(captured, sparkrun):
    store, recipe, receipt = captured
    reply = receipt["validation"]["reply"]
    assert receipt["state"] == "succeeded" and reply
    doc = sparkrun.json("inspect", "tiny-docker", "--store", str(store), "--json")
    unit = doc["config"]["units"][0]
    assert unit["driver_data"]["container"]["image"].startswith("sha256:")
    # sparkrun's persistent compile cache is mounted, as in sparkrun's own docker launches.
    assert "/cache/runtime" in unit["driver_data"]["container"]["volumes"].values()
    assert doc["config"]["fingerprint"]["container_runtime"].startswith("docker ")
    assert doc["config"]["workload"]["launch"]["image"].startswith("coldsnap/vllm-cpu:0.32.0@sha256:")
    # What is inside the image is recorded, read there: not null, not "None", and the image by name too.
    fp = doc["config"]["fingerprint"]
    assert fp["engine_version"] == doc["config"]["engine"]["version"] == "0.32.0"
    assert fp["python_version"].startswith("3.11.") and fp["torch_version"].startswith("2.13.0")  # the image's Debian Python
    assert unit["driver_data"]["container"]["image_name"] == "coldsnap/vllm-cpu:0.32.0"
    assert doc["manifest"]["annotations"]["dev.sparkrun.coldsnap.engine"] == "vllm 0.32.0"

    unpacked_before = unpacked_checkpoints()
    out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    assert "restored tiny-docker:latest" in out.stderr + out.stdout
    assert "that time counts from the start of the restore" in out.stderr + out.stdout  # two first-token times, told apart
    assert ask() == reply
    running = containers()
    assert len(running) == 1 and running[0]["Names"].startswith("sparkrun_") and running[0]["Names"].endswith("_solo")
    name = running[0]["Names"]
    info = json.loads(docker("inspect", name).stdout)[0]
    assert info["Config"]["Labels"]["sparkrun.distribution"] == "sparkrun"
    # An ordinary container for docker: removed on exit as sparkrun's own, memory on demand
    # through the runc wrapper, and nothing of the checkpoint kept.
    assert info["HostConfig"]["AutoRemove"] is True and info["HostConfig"]["Runtime"] == lazy_runtime.NAME
    assert docker("logs", name).returncode == 0
    # sparkrun's status lists it as its own job: the cluster id of its name, one container, up.
    lines = sparkrun("status", "-H", "localhost").stdout.splitlines()
    short = name.removeprefix("sparkrun_").removesuffix("_solo")
    job = [i for i, line in enumerate(lines) if line.startswith("Job: ") and "[%s]" % short in line]
    assert len(job) == 1 and "(1 container(s))" in lines[job[0]], lines
    assert lines[job[0] + 1].split()[0] == "solo" and " Up " in lines[job[0] + 1], lines
    logs = sparkrun("logs", str(recipe), "-H", "localhost", "-n", "5", check=False)
    assert logs.returncode == 0, logs.stderr
    time.sleep(1.0)  # the clean-up after the start runs beside the validation
    assert docker("checkpoint", "ls", "--format", "{{.Name}}", name).stdout.strip() == ""
    assert unpacked_checkpoints() <= unpacked_before
    sparkrun("stop", str(recipe), "-H", "localhost")
    assert_nothing_left(unpacked_before)
    restores = sorted((store / "receipts" / "tiny-docker").glob("*-restore.json"))
    r = json.loads(restores[-1].read_text())
    assert r["validation"]["passed"] and {p["name"] for p in r["phases"]} >= {"prepare.container", "restore", "validate"}
    # The container's processes, found by their host PIDs under its init, asked again for the
    # AMX tiles runc's CRIU restored them without (oneDNN uses them on an AMX host).
    if xstate_perm.tiles_supported():
        assert r["details"]["amx_permission"]["processes"] >= 2 and r["details"]["amx_permission"]["refused"] == 0, r["details"]
    else:
        assert "amx_permission" not in r["details"]


def test_docker_stop_treats_the_restored_container_like_any_other(captured, sparkrun):
    store, recipe, receipt = captured
    unpacked_before = unpacked_checkpoints()
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    name = containers()[0]["Names"]
    assert docker("stop", name).returncode == 0
    assert_nothing_left(unpacked_before)  # --rm, as sparkrun's own containers
    # ... and sparkrun sees it gone.
    status = sparkrun("status", "-H", "localhost").stdout
    assert name not in status


def test_a_run_while_the_restored_container_serves_replaces_it_once_the_new_one_is_staged(captured, sparkrun):
    store, recipe, receipt = captured
    unpacked_before = unpacked_checkpoints()
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    first = containers()
    assert len(first) == 1
    out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    text = out.stderr + out.stdout
    # Staged while the old one served, then the old one removed, then the restore.
    assert text.index("admitted and staged") < text.index("removing the container this run replaces") < text.index("restored tiny-docker:latest"), text[-3000:]
    now = containers()
    assert len(now) == 1 and now[0]["Names"] == first[0]["Names"] and now[0]["ID"] != first[0]["ID"]
    assert ask() == receipt["validation"]["reply"]
    sparkrun("stop", str(recipe), "-H", "localhost")
    assert_nothing_left(unpacked_before)


def test_a_container_holding_sparkruns_name_is_left_alone(captured, sparkrun):
    store, recipe, receipt = captured
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    name = containers()[0]["Names"]
    sparkrun("stop", str(recipe), "-H", "localhost")
    unpacked_before = unpacked_checkpoints()
    # Not sparkrun's (no owner label), so sparkrun's eviction leaves it where it is.
    holder = docker("create", "--name", name, IMAGE, "true")
    assert holder.returncode == 0, holder.stderr
    try:
        cp = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow", check=False)
        assert cp.returncode != 0
        errors = error_lines(cp)
        assert len(errors) == 1 and "a container named %s already exists (%s)" % (name, holder.stdout.strip()[:12]) in errors[0], cp.stderr[-2000:]
        assert [c["Names"] for c in containers()] == [name]  # the holder, untouched
    finally:
        docker("rm", "-f", name)
    assert_nothing_left(unpacked_before)


def test_a_capsule_of_another_image_is_refused_before_anything_is_created(captured, sparkrun, tmp_path):
    store, _, _ = captured
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text("NAME=other\n")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["docker", "import", "-", "coldsnap-test/other:1"], stdin=tar.stdout, capture_output=True, text=True)
    tar.wait()
    assert imported.returncode == 0, imported.stderr
    try:
        recipe = docker_recipe(tmp_path, store, replace={"container: coldsnap/vllm-cpu:0.32.0": "container: coldsnap-test/other:1"})
        unpacked_before = unpacked_checkpoints()
        # `sparkrun run` would start the recipe vanilla instead (on_incompatible: vanilla); restore refuses.
        cp = sparkrun.coldsnap("restore", str(recipe), "-H", "localhost", check=False)
        assert cp.returncode != 0
        errors = error_lines(cp)
        assert len(errors) == 1 and "image_digest: captured" in errors[0] and imported.stdout.strip() in errors[0], cp.stderr[-2000:]
        assert_nothing_left(unpacked_before)
    finally:
        docker("rmi", "coldsnap-test/other:1")


def dockerd_pid() -> int:
    return int(Path("/var/run/docker.pid").read_text().strip())


def runc_restoring() -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path("/proc/%s/comm" % entry).read_text().strip()
            cmd = Path("/proc/%s/cmdline" % entry).read_bytes().split(b"\0")
        except OSError:
            continue
        if comm in ("runc", lazy_runtime.NAME) and b"restore" in cmd:
            return True
    return False


def test_a_daemon_restart_during_the_restore_leaves_nothing_behind(captured, sparkrun):
    """dockerd dies while runc restores (a crash: SIGKILL) and is started again as setup does."""
    from sparkrun_coldsnap.setup.docker_install import start_daemon

    store, recipe, _ = captured
    unpacked_before = unpacked_checkpoints()
    containerd_before = containerd_left()
    argv = [str(BIN / "sparkrun"), "run", str(recipe), "-H", "localhost", "--no-follow"]
    run = subprocess.Popen(argv, env=sparkrun.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not runc_restoring():
            assert run.poll() is None, "the restore ended before runc ran: %s" % run.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "runc never started restoring"
            time.sleep(0.005)
        os.kill(dockerd_pid(), signal.SIGKILL)
    finally:
        start_daemon(print, restart=False)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode != 0
    errors = [l for l in stderr.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and "the docker daemon went away while restoring" in errors[0], stderr[-2000:]
    assert_nothing_left(unpacked_before)
    # nor a containerd task, its shim or its container, which docker no longer lists (the shim
    # exits once its task is deleted: a moment)
    deadline = time.monotonic() + 20
    while containerd_left() - containerd_before:
        assert time.monotonic() < deadline, "left in containerd: %s" % (containerd_left() - containerd_before)
        time.sleep(0.2)
