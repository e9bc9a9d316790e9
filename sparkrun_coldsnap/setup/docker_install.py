"""Docker for the container path: a daemon that checkpoints, and the CPU engine's image.

The daemon gets experimental mode (checkpoint and restore), a CRIU >= 4.2 for runc, the
CRIU options runc must pass, and one more OCI runtime, ``coldsnap-runc``: runc behind a
few lines of shell that restore memory on demand when a checkpoint asks for it
(launch/lazy_runtime.py). Adding the runtime needs no restart: dockerd rereads its
runtimes on SIGHUP.

No image can be pulled on the machines this project is built for, so the
engine image is made here: a Debian root file system from debootstrap (with
what vLLM on the CPU needs at run time: libnuma, and g++ with the Python
headers for the kernels torch's inductor compiles) plus the project's CPU vLLM
environment, imported with ``docker import``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.launch import docker as docker_unit
from sparkrun_coldsnap.launch import lazy_runtime
from sparkrun_coldsnap.setup import criu_host_copy, debian_packages

IMAGE = "coldsnap/vllm-cpu:0.32.0"
DAEMON_JSON = Path("/etc/docker/daemon.json")
DOCKERD_PIDFILE = Path("/var/run/docker.pid")
#: Where dockerd records the containerd it started.
CONTAINERD_PIDFILE = Path("/var/run/docker/containerd/containerd.pid")
CRIU_WRAPPER = criu_tool.WRAPPER
CRIU_HOST_PREFIX = criu_tool.HOST_PREFIX
ROOTFS_PACKAGES = ("python3", "python3-dev", "libnuma1", "g++", "procps", "ca-certificates")


def ensure_packages(log) -> None:
    missing = [p for p, exe in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(exe)]
    if missing:
        debian_packages.install(missing, log)


def _daemon_json() -> dict:
    try:
        return json.loads(DAEMON_JSON.read_text())
    except (OSError, ValueError):
        return {}


def _write_daemon_json(doc: dict) -> None:
    DAEMON_JSON.parent.mkdir(parents=True, exist_ok=True)
    DAEMON_JSON.write_text(json.dumps(doc, indent=2) + "\n")


def configure_daemon(log) -> bool:
    """Experimental mode (checkpoint/restore) in daemon.json; True if it changed (a restart is needed)."""
    doc = _daemon_json()
    if doc.get("experimental") is True:
        return False
    doc["experimental"] = True
    _write_daemon_json(doc)
    log("enabled experimental mode in %s (docker checkpoint needs it)" % DAEMON_JSON)
    return True


def lazy_runtime_installed(log) -> bool:
    """The runtime that restores memory on demand: its wrapper, and its entry in daemon.json.
    True if daemon.json changed (dockerd reloads runtimes on SIGHUP, no restart)."""
    runc = shutil.which("runc")
    if runc is None:
        raise ToolError("no runc on PATH for docker: install docker.io (it brings runc)")
    text = lazy_runtime.script(runc)
    if not lazy_runtime.WRAPPER.exists() or lazy_runtime.WRAPPER.read_text() != text:
        lazy_runtime.WRAPPER.parent.mkdir(parents=True, exist_ok=True)
        lazy_runtime.WRAPPER.write_text(text)
        lazy_runtime.WRAPPER.chmod(0o755)
        log("installed %s (runc that restores memory on demand when a checkpoint asks)" % lazy_runtime.WRAPPER)
    doc = _daemon_json()
    runtimes = doc.setdefault("runtimes", {})
    entry = {"path": str(lazy_runtime.WRAPPER)}
    if runtimes.get(lazy_runtime.NAME) == entry:
        return False
    runtimes[lazy_runtime.NAME] = entry
    _write_daemon_json(doc)
    log("added the docker runtime %s to %s" % (lazy_runtime.NAME, DAEMON_JSON))
    return True


def criu_for_runc(log) -> None:
    """runc runs whatever ``criu`` is on PATH: make that a CRIU >= 4.2."""
    first = criu_tool.for_runc()
    if first is not None and first.usable and first.source != "wrapper":
        return  # a CRIU that works is already there (the distribution's, or one installed by hand)
    if criu_tool.private_argv() is None:
        raise ToolError("no CRIU >= 4.2 to give docker: run `sparkrun coldsnap setup --criu` first")
    copied = criu_host_copy.install(paths.criu_prefix(), CRIU_HOST_PREFIX)
    host = criu_tool.private_argv(CRIU_HOST_PREFIX)
    if host is None:
        raise ToolError("the copy of the private CRIU at %s has no loader or criu: run `sparkrun coldsnap setup --criu`, then setup --docker again" % CRIU_HOST_PREFIX)
    text = criu_tool.wrapper_script(host)
    wrote = not (CRIU_WRAPPER.exists() and CRIU_WRAPPER.read_text() == text)
    if wrote:  # swapped in whole: a checkpoint starting meanwhile runs the old one or the new one
        CRIU_WRAPPER.parent.mkdir(parents=True, exist_ok=True)
        staged = CRIU_WRAPPER.with_name(".%s.new-%d" % (CRIU_WRAPPER.name, os.getpid()))
        staged.write_text(text)
        staged.chmod(0o755)
        os.replace(staged, CRIU_WRAPPER)
    if copied or wrote:
        log("installed %s for runc (it calls criu from PATH): it runs %s, a root-owned copy of the private CRIU in %s that every user's docker can run"
            % (CRIU_WRAPPER, CRIU_HOST_PREFIX, paths.criu_prefix()))  # fmt: skip
    first = criu_tool.for_runc()
    if first is None or Path(first.path) != CRIU_WRAPPER:
        raise ToolError("runc would run %s, not %s: put %s before it on PATH (dockerd's too), then run setup --docker again" % (first.path if first else "no criu", CRIU_WRAPPER, CRIU_WRAPPER.parent))
    if not first.usable:
        raise ToolError("%s cannot run the CRIU copied to %s: %s; run `sparkrun coldsnap setup --criu`, then setup --docker again" % (CRIU_WRAPPER, CRIU_HOST_PREFIX, first.problem))


def runc_options(log) -> None:
    conf = docker_unit.RUNC_CRIU_CONF
    added = docker_unit.missing_runc_options()
    if added:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("\n".join(docker_unit.runc_conf_lines() + added) + "\n")
        log("added %s to %s" % (", ".join(added), conf))


def _live_pid(pidfile: Path) -> int | None:
    """The PID *pidfile* names, if that process runs."""
    try:
        pid = int(pidfile.read_text().strip())
        # A killed daemon stays a zombie until its parent (often init) reaps it; it is gone all the same.
        return pid if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else None
    except (OSError, ValueError, psutil.Error):
        return None


def daemon_pid() -> int | None:
    """The running dockerd's PID, from the file it writes."""
    return _live_pid(DOCKERD_PIDFILE)


def _clear_stale_pidfiles() -> None:
    """A starting dockerd refuses to run while its pid file names a /proc entry, and waits for
    (instead of starting) the containerd its file names: a killed dockerd leaves both behind,
    naming zombies that init has not reaped yet."""
    orphan = _live_pid(CONTAINERD_PIDFILE) if daemon_pid() is None else None
    if orphan is not None:
        # The containerd of a dockerd that is gone dies on its own (or lingers): end it now,
        # or the new dockerd adopts it and waits for a socket that never answers.
        try:
            os.kill(orphan, signal.SIGKILL)
        except OSError:
            pass
        for _ in range(100):
            if _live_pid(CONTAINERD_PIDFILE) is None:
                break
            time.sleep(0.1)
    for pidfile in (DOCKERD_PIDFILE, CONTAINERD_PIDFILE):
        if pidfile.exists() and _live_pid(pidfile) is None:
            pidfile.unlink(missing_ok=True)


def reload_daemon(log) -> None:
    """Make a running dockerd read daemon.json again (runtimes are reloadable)."""
    pid = daemon_pid()
    if pid is None:
        return
    os.kill(pid, signal.SIGHUP)
    for _ in range(100):
        docker_unit.info.cache_clear()
        if lazy_runtime.NAME in docker_unit.info()["runtimes"].split(","):
            log("dockerd reloaded its runtimes")
            return
        time.sleep(0.1)
    raise ToolError("dockerd did not take the runtime %s from %s: see its log (%s)" % (lazy_runtime.NAME, DAEMON_JSON, paths.run_dir() / "dockerd.log"))


def start_daemon(log, *, restart: bool) -> None:
    daemon_running = docker_unit.daemon_running
    running = daemon_running()
    if running and not restart:
        return
    if running:
        log("restarting dockerd for the new settings")
        pid = daemon_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            if not daemon_running() and daemon_pid() is None:
                break
            time.sleep(0.1)
    _clear_stale_pidfiles()
    log("starting dockerd")
    logfile = open(paths.run_dir() / "dockerd.log", "ab")
    subprocess.Popen(["dockerd"], stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        if daemon_running():
            docker_unit.info.cache_clear()
            return
        time.sleep(0.1)
    raise ToolError("dockerd did not start within 60 s: see %s" % (paths.run_dir() / "dockerd.log"))


def build_image(log, *, engine: str = "vllm-cpu", tag: str = IMAGE, mirror: str | None = None) -> str:
    """debootstrap + the engine environment, imported as *tag*; returns the image id."""
    try:
        existing = docker_unit.image_id(tag)
        log("image %s already here (%s)" % (tag, existing[:19]))
        return existing
    except ToolError:
        pass  # not built yet
    env_dir = paths.engine_env_dir(engine).resolve()
    site = next((env_dir / "lib").glob("python3.*/site-packages"), None)
    if site is None:
        raise ToolError("engine environment %s is not installed: run `sparkrun coldsnap setup --engine %s` first" % (engine, engine))
    pyver = site.parent.name  # python3.11: the image's Debian python must be the same minor version
    from sparkrun_coldsnap.setup.criu_install import debian_mirror

    work = Path(tempfile.mkdtemp(prefix="coldsnap-image-", dir=paths.run_dir()))
    try:
        rootfs = work / "rootfs"
        log("debootstrap of Debian bookworm with %s (a minute or two)" % ", ".join(ROOTFS_PACKAGES))
        run(["debootstrap", "--variant=minbase", "--include=" + ",".join(ROOTFS_PACKAGES), "bookworm", str(rootfs), mirror or debian_mirror()], timeout=1800, what="debootstrap")
        if not (rootfs / "usr" / "bin" / pyver).exists():
            raise ToolError("the image's Debian has no %s for the engine environment built with it" % pyver)
        engine_root = rootfs / "opt" / "engine"
        log("copying the engine environment (%s) into the image" % engine)
        shutil.copytree(site, engine_root / "lib" / pyver / "site-packages", symlinks=True)
        (engine_root / "bin").mkdir(parents=True)
        os.symlink("/usr/bin/" + pyver, engine_root / "bin" / "python")
        (engine_root / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\nversion = %s\n" % pyver.replace("python", ""))
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        log("docker import as %s" % tag)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = run(["docker", "import", "-", tag], stdin=tar.stdout, timeout=1800, what="docker import")
        finally:
            tar.wait()
        return imported.stdout.strip()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def setup_docker(log) -> None:
    ensure_packages(log)
    changed = configure_daemon(log)
    criu_for_runc(log)
    runc_options(log)
    runtimes_changed = lazy_runtime_installed(log)
    paths.run_dir().mkdir(parents=True, exist_ok=True)
    if runtimes_changed and not changed and docker_unit.daemon_running():
        reload_daemon(log)
    start_daemon(log, restart=changed)
    log("image %s: %s" % (IMAGE, build_image(log)[:19]))
