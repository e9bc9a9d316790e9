"""Container launch units: the engine in a Docker container, checkpointed through the runtime.

sparkrun starts a container that sleeps and ``docker exec``-s the engine into
it, with ``--rm``, a non-root user, a seccomp profile that allows io_uring
and only SYS_PTRACE. For capture the plugin changes what a checkpoint cannot
live with, and nothing else:

* the engine is the container's main process (``bash -c 'exec CMD'``): CRIU
  dumps the tree under the container's init, and an exec'd process is not in
  it. Its output still goes to ``/tmp/sparkrun_serve.log`` inside the
  container, where ``sparkrun logs`` reads it;
* no ``--rm``: the container must outlive its checkpoint;
* root in the container and Docker's default security profile: CRIU runs from
  the host either way, and io_uring is kept off by the host switch during capture;
* a private IPC namespace: its /dev/shm is a tmpfs inside the container, whose
  content CRIU saves with the images (sparkrun's ``shareable`` mode bind-mounts
  it from the host, and CRIU leaves external mounts out; the engine's ring
  buffers live there).

Network (host), /dev/shm size, volumes, environment, labels and name are
sparkrun's. A restore creates a NEW container from the same image with the same
settings under a temporary name during preparation, loads the captured writable
layer into it and points its checkpoint at the staged images, and after eviction
renames it to sparkrun's name and starts it from the checkpoint
(container_restore.py says how, and what it does on faults).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.criu.tool import log_tail
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.logfile import last_line
from sparkrun_coldsnap.host.runner import Completed, run
from sparkrun_coldsnap.launch import gpu_devices
from sparkrun_coldsnap.weights import container_mounts, native_payload, weights_memory

LOG_IN_CONTAINER = "/tmp/sparkrun_serve.log"
ROOTFS_TAR = "coldsnap-rootfs.tar"
CHECKPOINT = "coldsnap"


def docker(*args: str, timeout: float = 600, check: bool = True, input: str | None = None) -> Completed:
    return run(["docker", *args], timeout=timeout, check=check, input=input, what="docker %s" % args[0])


@functools.lru_cache(maxsize=1)
def info() -> dict[str, str]:
    """Server facts that decide whether a checkpoint restores: version, storage, cgroups, root dir."""
    out = docker("info", "--format", "{{json .}}", timeout=60)
    doc = json.loads(out.stdout)
    return {
        "server_version": str(doc.get("ServerVersion")),
        "storage_driver": str(doc.get("Driver")),
        "cgroup_version": str(doc.get("CgroupVersion")),
        "root_dir": str(doc.get("DockerRootDir")),
        "experimental": str(doc.get("ExperimentalBuild")).lower(),
        "runtimes": ",".join(sorted(doc.get("Runtimes") or {})),
    }


RUNC_CRIU_CONF = Path("/etc/criu/runc.conf")
# What runc's CRIU must be told for an inference server (runc reads this file on
# every checkpoint and restore, and its settings win over those runc passes): semaphores
# whose mapped name was deleted need link remapping, and unlinked shared memory can exceed
# the default ghost limit. torch.distributed's store keeps a TCP connection to itself open
# in every GPU engine (vLLM's, even with one rank): both ends are in the tree, dumped and
# restored in repair mode; with the host's network (every container the plugin starts) there
# is no namespace of the container's own to lock, as for the host-process tree (criu/tree.py).
RUNC_CRIU_OPTIONS = ("link-remap", "ghost-limit 256M", "tcp-established", "network-lock skip")


def runc_conf_lines() -> list[str]:
    try:
        return [l for l in RUNC_CRIU_CONF.read_text().splitlines() if l.strip()]
    except OSError:
        return []


def missing_runc_options() -> list[str]:
    """The options runc's CRIU needs that its configuration does not set (by option name)."""
    keys = {l.split()[0] for l in runc_conf_lines()}
    return [opt for opt in RUNC_CRIU_OPTIONS if opt.split()[0] not in keys]


def daemon_running() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return docker("info", check=False, timeout=30).returncode == 0
    except ToolError:  # no answer within the timeout
        return False


def check_checkpointing() -> None:
    """The daemon can checkpoint: experimental mode, a CRIU >= 4.2 on PATH for runc, runc's CRIU options."""
    from sparkrun_coldsnap.criu import tool as criu_tool

    problems = []
    if info().get("experimental") != "true":
        problems.append('dockerd is not in experimental mode (set {"experimental": true} in /etc/docker/daemon.json)')
    criu = criu_tool.for_runc()
    if criu is None:
        problems.append("runc finds no criu on PATH")
    elif not criu.usable:
        problems.append("the criu runc runs (%s) cannot be used: %s" % (criu.path, criu.problem))
    missing = missing_runc_options()
    if missing:
        problems.append("%s lacks %s" % (RUNC_CRIU_CONF, ", ".join(missing)))
    if problems:
        raise ToolError("docker cannot checkpoint containers here: %s; run `sparkrun coldsnap setup --docker`" % "; ".join(problems))


def runtime_summary() -> str:
    i = info()
    return "docker %s, %s, cgroup v%s" % (i["server_version"], i["storage_driver"], i["cgroup_version"])


def image_id(image: str) -> str:
    out = docker("image", "inspect", "--format", "{{.Id}}", image, check=False, timeout=60)
    if out.returncode != 0:
        raise ToolError("image %s is not on this host: build or load it first (sparkrun coldsnap setup --docker builds the CPU engine's)" % image)
    return out.stdout.strip()


def image_env(image: str) -> dict[str, str]:
    """The environment *image* sets (its ENV lines); empty where the image is not here."""
    try:
        out = docker("image", "inspect", "--format", "{{json .Config.Env}}", image, check=False, timeout=60)
    except ToolError:
        return {}
    if out.returncode != 0:
        return {}
    pairs = json.loads(out.stdout or "null") or []
    return dict(p.split("=", 1) for p in pairs if "=" in p)


@dataclass(frozen=True)
class ContainerSpec:
    """Everything ``docker create`` needs, recorded in the capsule to recreate the container."""

    image: str  # image id (sha256:...)
    command: str
    env: Mapping[str, str]
    volumes: Mapping[str, str]  # host path -> container path
    shm_size: str = "32g"
    labels: Mapping[str, str] = field(default_factory=dict)
    #: GPU indices the container gets, as entries of its spec (gpu_container.py says why)
    gpus: tuple[str, ...] = ()
    #: the name the recipe gave the image (``repo:tag``), recorded beside its id for people
    image_name: str | None = None
    #: the native weights' directories, role -> path in the container (weights/container_mounts.py)
    weights_volumes: Mapping[str, str] = field(default_factory=dict)

    def prepare_host(self) -> None:
        """What the container binds made ready on this host before docker binds it: the
        payload's root, the shared tmpfs mounted (a bind of its empty directory would see nothing)."""
        if self.weights_volumes:
            native_payload.root().mkdir(parents=True, exist_ok=True)
            weights_memory.mount_shared_root()

    def create_args(self, name: str, *, auto_remove: bool = False, runtime: str | None = None) -> list[str]:
        """``docker create`` arguments; *auto_remove* as sparkrun's own launches (never for a
        container that will be checkpointed: the checkpoint stops it), *runtime* an OCI runtime
        other than the daemon's default."""
        args = ["create", "--name", name, "--network=host", "--ipc=private", "--shm-size=%s" % self.shm_size]
        if auto_remove:
            args.append("--rm")
        if runtime:
            args += ["--runtime", runtime]
        for k, v in sorted(self.labels.items()):
            args += ["--label", "%s=%s" % (k, v)]
        for k, v in sorted(self.env.items()):
            args += ["-e", "%s=%s" % (k, v)]
        args += self._bind_args()
        # The engine is the main process; its output goes where sparkrun logs reads.
        args += [self.image, "bash", "-c", "exec %s > %s 2>&1" % (self.command, LOG_IN_CONTAINER)]
        return args

    def _bind_args(self) -> list[str]:
        """What the container gets from the host: the recipe's volumes, the native weights'
        directories and, for a GPU container, its device nodes and the driver's files."""
        args: list[str] = []
        for host, target in sorted(self.volumes.items()):
            args += ["-v", "%s:%s" % (host, target)]
        args += container_mounts.volume_args(self.weights_volumes)
        if self.gpus:
            args += gpu_devices.device_args(self.gpus)
        return args

    def bind_targets(self) -> list[str]:
        """Every path in the container that ``docker create`` binds from the host."""
        args = self._bind_args()
        return [args[i + 1].split(":")[1] for i, a in enumerate(args[:-1]) if a == "-v"]

    def to_json(self) -> dict:
        doc = {"image": self.image, "command": self.command, "env": dict(self.env), "volumes": dict(self.volumes), "shm_size": self.shm_size}
        if self.gpus:
            doc["gpus"] = list(self.gpus)
        if self.image_name:
            doc["image_name"] = self.image_name
        if self.weights_volumes:
            doc["weights_volumes"] = dict(self.weights_volumes)
        return doc

    @classmethod
    def from_json(cls, doc: dict, *, labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None, volumes: Mapping[str, str] | None = None) -> ContainerSpec:
        return cls(
            doc["image"], doc["command"], dict(env if env is not None else doc["env"]), dict(volumes if volumes is not None else doc["volumes"]),
            doc.get("shm_size", "32g"), dict(labels or {}), tuple(doc.get("gpus", ())), doc.get("image_name"), dict(doc.get("weights_volumes") or {}),
        )  # fmt: skip


@dataclass
class ContainerUnit:
    """A running container started by the plugin."""

    name: str
    container_id: str
    spec: ContainerSpec | None = None
    #: a prepared restore's images (links in its checkpoint point here), until it has started
    images: Path | None = None
    #: the prepared restore brings memory back on demand
    lazy: bool = False
    #: seconds each step of a restore into this container took
    steps: dict[str, float] = field(default_factory=dict)
    #: the prepared restore's lazy-pages daemon (a Popen), until the restore has started
    lazy_daemon: Any = None
    #: a restore's processes given back their AMX tile permission (None: the host has no tiles)
    amx_permission: dict[str, int] | None = None
    #: the prepared restore leaves the tree stopped, for a memory fill of the pages its images'
    #: split took out (criu/page_fill.py)
    fill: bool = False
    #: what that split did, and what the fill did (for the receipt)
    fill_split: dict[str, Any] | None = None
    page_fill: dict[str, Any] | None = None

    @property
    def root_pid(self) -> int:
        out = docker("inspect", "--format", "{{.State.Pid}}", self.container_id, check=False, timeout=60)
        try:
            return int(out.stdout.strip() or 0)
        except ValueError:
            return 0

    def alive(self) -> bool:
        out = docker("inspect", "--format", "{{.State.Running}}", self.container_id, check=False, timeout=60)
        return out.stdout.strip() == "true"

    @functools.cached_property
    def log_path(self) -> Path:
        # The writable layer's place does not change while the container exists: asked once,
        # not on every tick of a readiness wait.
        return upper_dir(self.container_id) / LOG_IN_CONTAINER.lstrip("/")

    def tail(self) -> str:
        return last_line(self.log_path)

    def log_location(self) -> str:
        return "container %s, %s" % (self.name, LOG_IN_CONTAINER)

    def remove(self) -> None:
        docker("rm", "-f", self.container_id, check=False, timeout=120)
        self.stop_lazy_daemon()
        if self.images is not None:
            shutil.rmtree(self.images, ignore_errors=True)
            self.images = None

    def stop_lazy_daemon(self) -> None:
        if self.lazy_daemon is not None:
            from sparkrun_coldsnap.criu.tree import stop_lazy_daemon

            stop_lazy_daemon(self.lazy_daemon)
            self.lazy_daemon = None

    def stop(self, grace: float = 10.0) -> None:
        self.remove()

    def reap(self, timeout: float = 10.0) -> None:
        """Nothing to reap: dockerd is the parent."""


def named_container(name: str) -> tuple[str, dict[str, str]] | None:
    """The id and labels of the container called *name*, if there is one."""
    out = docker("inspect", "--type", "container", "--format", "{{.Id}} {{json .Config.Labels}}", name, check=False, timeout=60)
    if out.returncode != 0 or not out.stdout.strip():
        return None
    cid, _, labels = out.stdout.strip().partition(" ")
    return cid, json.loads(labels) or {}


def start_container(spec: ContainerSpec, name: str) -> ContainerUnit:
    docker("rm", "-f", name, check=False, timeout=120)
    spec.prepare_host()
    out = docker(*spec.create_args(name), timeout=300)
    cid = out.stdout.strip().splitlines()[-1]
    docker("start", cid, timeout=300)
    return ContainerUnit(name, cid, spec)


def upper_dir(container: str) -> Path:
    out = docker("inspect", "--format", "{{.GraphDriver.Data.UpperDir}}", container, timeout=60)
    return Path(out.stdout.strip())


def layer_dirs(container: str) -> list[Path]:
    """The container's file system as overlay2 stacks it, top first: its writable layer, then
    the image's layers (docker's init layer first)."""
    out = docker("inspect", "--format", "{{.GraphDriver.Data.UpperDir}}|{{.GraphDriver.Data.LowerDir}}", container, timeout=60)
    upper, _, lower = out.stdout.strip().partition("|")
    return [Path(p) for p in [upper, *lower.split(":")] if p and p != "<no value>"]


def resolve_in_layers(path: str, layers: Iterable[Path], *, max_links: int = 40) -> str:
    """*path* as the container's processes reach it: the symbolic links among its directories
    followed through the stacked *layers* (the topmost that has a name decides), relative to the
    container's root. The last name is not followed: a mount point is the name itself."""
    layers = list(layers)
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        link = None
        if todo:  # a directory on the way
            for layer in layers:
                here = layer.joinpath(*done, name)
                if os.path.lexists(here):
                    link = os.readlink(here) if here.is_symlink() else None
                    break
        if link is None or links >= max_links:
            done.append(name)
            continue
        links += 1
        if link.startswith("/"):
            done = []
        todo = [p for p in link.split("/") if p] + todo
    return "/".join(done)


def container_dir(container_id: str) -> Path:
    return Path(info()["root_dir"]) / "containers" / container_id


def checkpoint(unit: ContainerUnit, images: Path) -> None:
    """``docker checkpoint create`` (the container stops), then move the images and the writable layer out.

    The compile-cache files the processes map are copied first, while they run (volume_files.py).
    """
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.launch import volume_files

    root = unit.root_pid
    images.parent.mkdir(parents=True, exist_ok=True)
    cache_files = images.parent / (images.name + ".volume-files")
    shutil.rmtree(cache_files, ignore_errors=True)
    volume_files.save(volume_files.in_use(tree_pids(root)), Path("/proc/%d/root" % root), cache_files)
    out = docker("checkpoint", "create", unit.container_id, CHECKPOINT, check=False, timeout=1800)
    if out.returncode != 0:
        kept = keep_dump_log(out.stdout + out.stderr, unit.name)
        where = "; CRIU's log: %s (%s)" % (kept, log_tail(kept)) if kept is not None else ""
        raise ToolError("docker checkpoint of %s failed: %s%s" % (unit.name, out.tail(), where))
    source = container_dir(unit.container_id) / "checkpoints" / CHECKPOINT
    shutil.move(str(source), str(images))
    if (cache_files / volume_files.STORED).exists():
        os.rename(cache_files / volume_files.STORED, images / volume_files.STORED)
    shutil.rmtree(cache_files, ignore_errors=True)
    binds = unit.spec.bind_targets() if unit.spec is not None else []
    layers = layer_dirs(unit.container_id)
    write_rootfs_tar(layers[0], images / ROOTFS_TAR, mount_points=binds, layers=layers)


#: runc names CRIU's log of a failed checkpoint in its error: ``path= <task dir>/criu-dump.log``.
DUMP_LOG_IN_ERROR = re.compile(r"(/\S+/criu-dump\.log)")


def keep_dump_log(error: str, name: str) -> Path | None:
    """Copy CRIU's log of a failed ``docker checkpoint`` out of containerd's task directory,
    which goes with the container once it is removed (a failed checkpoint leaves it running,
    so the log is still there now); the copy's path, or None where there is none."""
    match = DUMP_LOG_IN_ERROR.search(error)
    if match is None or not Path(match.group(1)).is_file():
        return None
    kept = paths.run_dir() / "logs" / ("container-checkpoint-%s.log" % name)
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(match.group(1), kept)
    return kept


def write_rootfs_tar(upper: Path, target: Path, *, mount_points: Iterable[str] = (), layers: Iterable[Path] = ()) -> None:
    """The container's writable layer as a tar, without sockets or overlay whiteouts, and
    without the files and directories runc made for the container's binds (*mount_points*):
    loaded into the new container they would be written through its binds, and a read-only
    one refuses. A bind's target is where the container's processes reach it, through the
    image's links (*layers*, top first): a bind at /lib/x in an image whose /lib links to
    usr/lib leaves its mount point at usr/lib/x."""
    layers = list(layers) or [upper]
    skipped = {resolve_in_layers(p.split(":", 1)[0], layers) for p in mount_points}  # a volume's target may carry :ro

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.name.strip("/") in skipped:
            return None
        return info if (info.isfile() or info.isdir() or info.issym() or info.islnk()) else None

    with tarfile.open(target, "w") as tar:
        for entry in sorted(os.listdir(upper)):
            tar.add(str(upper / entry), arcname=entry, filter=keep)


#: The label a prepared restore carries naming the directory of its images.
IMAGES_LABEL = "coldsnap.images"


def remove_stale(prefix: str) -> None:
    """Containers an earlier preparation created and no activation started, and their images."""
    out = docker("ps", "-a", "--filter", "name=^%s" % prefix, "--filter", "status=created", "--format", '{{.ID}} {{.Label "%s"}}' % IMAGES_LABEL, check=False, timeout=60)
    for line in out.stdout.splitlines():
        cid, _, images = line.partition(" ")
        docker("rm", "-f", cid, check=False, timeout=120)
        if images.strip():
            shutil.rmtree(images.strip(), ignore_errors=True)


def leftover_pids(container_id: str, cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[int]:
    """Processes still in the container's cgroups (docker's cgroupfs and systemd layouts, v1 and v2)."""
    pids: set[int] = set()
    patterns = ("*/docker/%s/cgroup.procs", "docker/%s/cgroup.procs", "*/system.slice/docker-%s.scope/cgroup.procs", "system.slice/docker-%s.scope/cgroup.procs")
    for pattern in patterns:
        for procs in cgroup_root.glob(pattern % container_id):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except (OSError, ValueError):
                continue
    return sorted(pids)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
