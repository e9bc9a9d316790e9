"""Restoring a captured container into a new one that docker and sparkrun treat as their own.

Preparation (before eviction, off the clock):
  refuse when docker's root has no room for the container's writable layer; put back
  the compile-cache files the processes map where the host's cache lacks them
  (volume_files.py); create
  the container from the captured image id with sparkrun's settings under a temporary
  name (``--rm`` as sparkrun's own, and the memory-on-demand runtime when installed);
  load the captured writable layer; move the staged images to the container (a rename
  on tmpfs) and fill its checkpoint with links to them (checkpoint_links.py); when
  memory comes on demand, start the lazy-pages daemon that will serve it. Otherwise,
  where the page fill is on and the runtime can leave the restored tree stopped
  (lazy_runtime.py), split the images for a fill (criu/page_fill.py): CRIU then restores
  the big private anonymous areas as zeros, and the checkpoint asks for a stopped tree.
  Images already split whose runtime cannot leave the tree stopped are refused here:
  they must never start with zeros for memory.

Activation (on the clock):
  take sparkrun's name, refusing when another container holds it; ``docker start
  --checkpoint``; with a fill, write the pages the split took out into the stopped
  processes (by their host PIDs, from several threads); give the restored processes back
  their AMX tile permission (host/xstate_perm.py); continue a stopped tree. Then, off the
  clock, drop docker's checkpoint and containerd's unpacked copy (both links).

Faults leave nothing behind: the container is removed (docker's ``--rm`` removes a
container whose start failed, and a restarted daemon removes one it finds half-started),
and so are the daemon, the images, the unpacked copy, and the task and container a daemon
that died mid-start left in containerd (containerd_leftovers.py). A daemon that went away is
waited for, so that the container can be removed once it is back.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from pathlib import Path

from sparkrun_coldsnap.criu import page_fill
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu, log_tail
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import RestoreError, ToolError
from sparkrun_coldsnap.host import disk_room, paths, xstate_perm
from sparkrun_coldsnap.host.process_tree import continue_tree
from sparkrun_coldsnap.host.threads import start_thread
from sparkrun_coldsnap.launch import checkpoint_leftovers, checkpoint_links, containerd_leftovers, lazy_runtime, volume_files
from sparkrun_coldsnap.launch import docker as d

#: What docker's root must hold beyond the writable layer: the container's config,
#: its log, the checkpoint's links, containerd's bookkeeping.
ROOM_MARGIN = 256 << 20
#: How long a restore waits for a daemon that went away, to remove the container.
DAEMON_RETURN_SECONDS = 60.0
#: What the docker client says when the daemon is gone mid-call.
DAEMON_GONE = ("Cannot connect to the Docker daemon", "error during connect", "connection reset", "EOF")


def memory_on_demand() -> bool:
    """Restore memory on demand: CRIU and the kernel can, and the runtime that asks runc for it is installed."""
    return lazy_runtime.installed(d.info().get("runtimes", "")) and criu_tree.lazy_pages_supported(Criu.locate())


def check_room(layer: Path) -> None:
    root = Path(d.info()["root_dir"])
    need = (layer.stat().st_size if layer.exists() else 0) + ROOM_MARGIN
    free = disk_room.free_bytes(root)
    if free < need:
        raise RestoreError("not enough disk space under docker's root %s for the restored container: its writable layer needs about %.2f GB, %.2f GB are free; free space there and run again" % (root, need / 1e9, free / 1e9))


def prepare_restore(spec: d.ContainerSpec, images: Path, temp_name: str, *, lazy: bool | None = None, fill: bool | None = None) -> d.ContainerUnit:
    """Create the new container under *temp_name* and load it (before eviction); *images* become
    its own. *lazy*: restore memory on demand (None: whenever this host can). *fill*: without
    memory on demand, write the big areas after CRIU from several threads (None: as the
    page fill setting says), where the runtime can leave the tree stopped for it."""
    d.remove_stale(temp_name.rsplit("-", 1)[0] + "-")
    check_room(images / d.ROOTFS_TAR)
    volume_files.put_back(images, spec.volumes)
    spec.prepare_host()
    lazy = memory_on_demand() if lazy is None else lazy and memory_on_demand()
    split = _split_for_fill(images, lazy=lazy, wanted=settings.current().page_fill_threads > 0 if fill is None else fill)
    filling = split is not None and page_fill.fill_planned(images)
    lazy = lazy and not filling  # the fill writes every page before the tree runs
    home = checkpoint_links.home_for(images, temp_name)
    # The label names the images' new home, so that a later preparation can remove both
    # when this one never reaches its activation.
    spec = dataclasses.replace(spec, labels={**spec.labels, d.IMAGES_LABEL: str(home)})
    out = d.docker(*spec.create_args(temp_name, auto_remove=True, runtime=lazy_runtime.NAME if lazy or filling else None), check=False, timeout=300)
    if out.returncode != 0:
        raise RestoreError("creating the container for the restore failed: %s" % out.tail(1))
    cid = out.stdout.strip().splitlines()[-1]
    unit = d.ContainerUnit(temp_name, cid, spec, fill_split=split)
    try:
        rootfs = images / d.ROOTFS_TAR
        if rootfs.exists():
            with open(rootfs, "rb") as f:
                cp = subprocess.run(["docker", "cp", "-", "%s:/" % cid], stdin=f, capture_output=True, text=True, timeout=600)
            if cp.returncode != 0:
                raise RestoreError("loading the captured writable layer into the new container failed: %s" % cp.stderr.strip()[-300:])
        unit.images = checkpoint_links.own_images(images, home)
        if filling:
            checkpoint_links.ask_leave_stopped(unit.images)
        checkpoint_links.link_images(unit.images, d.container_dir(cid) / "checkpoints" / d.CHECKPOINT, lazy=lazy)
        unit.lazy, unit.fill = lazy, filling
        if lazy:
            # Memory on demand: the tree resumes before its memory is copied, and this daemon
            # fills each page when it is first touched, then removes the images once every
            # page is delivered. It only listens until the restore connects: started here,
            # off the clock.
            unit.lazy_daemon = criu_tree.start_lazy_daemon(Criu.locate(), unit.images, unit.images)
    except BaseException:
        unit.remove()
        raise
    return unit


def _split_for_fill(images: Path, *, lazy: bool, wanted: bool) -> dict | None:
    """Split *images* for a fill when *wanted* and the runtime can leave the tree stopped; what
    the split did (None: no split). Images an earlier preparation split are refused where
    the runtime cannot: CRIU would restore their big areas as zeros and let them run."""
    can_stop = lazy_runtime.leaves_stopped(d.info().get("runtimes", ""))
    already_split = page_fill.fill_planned(images)
    if already_split and not can_stop:
        why = "docker's runtime %s is not installed or cannot leave the restored tree stopped for it" % lazy_runtime.NAME
        raise RestoreError("the staged images in %s were split for a memory fill, but %s: run `sparkrun coldsnap setup --docker`, then restore again" % (images, why))
    if not already_split and (lazy or not wanted or not can_stop):
        return None  # CRIU writes every page itself
    return page_fill.split_for_fill(images).to_json()  # an earlier split's images: counts what it moved


def start_from_checkpoint(unit: d.ContainerUnit, name: str) -> d.ContainerUnit:
    """Give the prepared container sparkrun's *name* (the old workload is gone by now) and
    resume it from its checkpoint.

    The seconds each step took land in ``unit.steps``; what the memory fill did in
    ``unit.page_fill``; the processes given back their AMX tile permission in
    ``unit.amx_permission``.
    """
    images = unit.images
    assert images is not None, "start of a container that was not prepared"
    steps = unit.steps
    t = time.monotonic()
    if unit.name != name:
        try:
            _take_name(unit, name)
        except BaseException:
            unit.remove()  # the prepared container, its lazy-pages daemon and its images
            raise
    t = _step(steps, "rename", t)
    try:
        out = d.docker("start", "--checkpoint", d.CHECKPOINT, unit.container_id, check=False, timeout=1800)
    except BaseException as err:
        _give_up(unit, str(err))
        raise
    if out.returncode != 0:
        _give_up(unit, out.tail(1))
    t = _step(steps, "docker_start_checkpoint", t)
    root = unit.root_pid
    if unit.fill:
        _fill(unit, images, root)
        t = _step(steps, "page_fill", t)
    # runc's CRIU restored the tree without its AMX tile permission: the container's processes
    # are the host's too (by their host PIDs, under the container's init), asked again here,
    # before anything reaches the engine (a filled tree is still stopped).
    unit.amx_permission = xstate_perm.give_back_tiles(root, unit_name=unit.name)
    if unit.amx_permission is not None:
        t = _step(steps, "amx_permission", t)
    if unit.fill:
        continue_tree(root)
        _step(steps, "continue", t)
    # From here on the daemon, if any, lives as long as the restored tree needs it.
    unit.lazy_daemon, unit.images = None, None
    # Clearing up after the start is off the clock: docker's checkpoint (links) and
    # containerd's unpacked copy (links), and, with every page copied, the images. A
    # thread the interpreter waits for at exit, so it ends before `sparkrun run` does.
    start_thread(_after_start, unit.container_id, images, unit.lazy, name="coldsnap-restore-cleanup")
    return unit


def _fill(unit: d.ContainerUnit, images: Path, root: int) -> None:
    """Write the pages the split took out of *images* into the container's stopped tree at
    *root* (a host PID); on failure remove the container, which would run with zeros."""
    try:
        if root <= 1:
            raise RestoreError("docker reports no running init for the container")
        report = page_fill.fill(images, root, threads=max(1, settings.current().page_fill_threads))
    except BaseException as err:
        _drop_unpacked(images)
        unit.remove()
        left = d.leftover_pids(unit.container_id)
        if left:
            d.kill_pids(left)
        if isinstance(err, (RestoreError, OSError, ValueError, KeyError)):
            raise RestoreError("the memory fill of the restored container %s failed: %s; the container was removed" % (unit.name, err)) from err
        raise
    unit.page_fill = report.to_json()


def _take_name(unit: d.ContainerUnit, name: str) -> None:
    """Rename *unit* to *name*; refuse (one line) if another container holds the name."""
    out = d.docker("rename", unit.container_id, name, check=False, timeout=60)
    if out.returncode == 0:
        unit.name = name
        return
    holder = name_holder(name)
    if holder and holder != unit.container_id:
        raise RestoreError("a container named %s already exists (%s) and this restore will not remove it: stop that workload (sparkrun stop) or remove it (docker rm -f %s), then run again" % (name, holder[:12], name))
    raise RestoreError("renaming the restored container to %s failed: %s" % (name, out.tail(1)))


def name_holder(name: str) -> str | None:
    """The id of the container called *name*, if there is one."""
    held = d.named_container(name)
    return held[0] if held is not None else None


def _after_start(container_id: str, images: Path, lazy: bool) -> None:
    _drop_unpacked(images)
    d.docker("checkpoint", "rm", container_id, d.CHECKPOINT, check=False, timeout=120)
    if not lazy:
        checkpoint_links.remove(images)  # CRIU has read them: the processes run from memory


def _step(steps: dict[str, float], name: str, since: float) -> float:
    now = time.monotonic()
    steps[name] = round(now - since, 4)
    return now


def _drop_unpacked(images: Path, keep_log: Path | None = None) -> None:
    """Remove containerd's unpacked copies of this checkpoint, keeping CRIU's log of the restore if asked."""
    if keep_log is not None:
        for parent in checkpoint_leftovers.containerd_temp_dirs():
            for copy in parent.glob(checkpoint_leftovers.PREFIX + "*"):
                if checkpoint_links.points_into(copy, images) and (copy / criu_tree.RESTORE_LOG).is_file():
                    keep_log.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(copy / criu_tree.RESTORE_LOG, keep_log)
    checkpoint_leftovers.remove_unpacked_copies(images)


def _give_up(unit: d.ContainerUnit, reason: str) -> None:
    """Remove everything this restore made, then raise one line saying what failed."""
    images = unit.images
    unit.stop_lazy_daemon()
    keep = paths.run_dir() / "logs" / ("container-restore-%s.log" % unit.name)
    keep.unlink(missing_ok=True)
    if images is not None:
        _drop_unpacked(images, keep_log=keep)
        if (images / criu_tree.RESTORE_LOG).is_file():  # kept there by the runtime (lazy_runtime.py)
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(images / criu_tree.RESTORE_LOG, keep)
    where = "; CRIU's log: %s (%s)" % (keep, log_tail(keep)) if keep.exists() else ""
    gone = not d.daemon_running() or any(s in reason for s in DAEMON_GONE)
    back = _wait_for_daemon() if gone else True
    if gone and back and images is not None:
        # The copies are found through the running containerd's temporary directory: with
        # the daemon gone there was none to look in before it came back.
        _drop_unpacked(images)
    unit.remove()  # docker rm -f, and the images
    if back:
        # A daemon that died mid-start forgot the container but left containerd's task (its
        # shim running) and container, which docker no longer lists.
        containerd_leftovers.remove(unit.container_id)
    if not back:
        raise RestoreError(
            "the docker daemon went away while restoring %s (%s) and has not come back within %.0f s: once dockerd runs, remove the container with `docker rm -f %s`" % (unit.name, reason, DAEMON_RETURN_SECONDS, unit.container_id[:12])
        )
    left = d.leftover_pids(unit.container_id)
    if left:
        d.kill_pids(left)
    if gone:
        raise RestoreError("the docker daemon went away while restoring %s (%s); the half-restored container was removed: run again" % (unit.name, reason))
    raise RestoreError("docker start --checkpoint of %s failed: %s%s; the container was removed" % (unit.name, reason, where))


def _wait_for_daemon() -> bool:
    deadline = time.monotonic() + DAEMON_RETURN_SECONDS
    while time.monotonic() < deadline:
        try:
            if d.daemon_running():
                return True
        except ToolError:
            pass
        time.sleep(0.5)
    return False
