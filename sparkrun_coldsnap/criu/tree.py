"""CRIU dump and restore of one process tree, with what CRIU leaves out.

Three things a plain ``criu dump``/``criu restore`` pair gets wrong for an
inference server, handled here:

* files on shared-memory filesystems (``/dev/shm/psm_*`` ring buffers, named
  semaphores) that still have a name: CRIU records only their path, not their
  content, so the content at dump time is saved beside the images and put
  back before each restore;
* ``link_remap.N`` files CRIU creates during the dump for files whose mapped
  name was deleted but which still have another link: restore consumes them,
  so they are saved with the images and recreated before each restore (else a
  capsule restores once);
* the output file: CRIU refuses a regular file whose size changed since the
  dump, so restore hands it a fresh log through ``--inherit-fd``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from sparkrun_coldsnap.criu import page_fill, tree_inspect
from sparkrun_coldsnap.criu.tool import Criu, how_it_ended, log_tail
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.unit_image import SharedFile, UnitImage
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.host import connections, major_faults, paths, peer_lock, xstate_perm
from sparkrun_coldsnap.host.process_tree import continue_tree, fd_targets, kill_tree, remove_leaked_semaphores, shared_memory_files, tree_pids, users_of
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.host.sparse import copy_sparse
from sparkrun_coldsnap.progress import Report as Progress

BASE_FLAGS = ("--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", "256M")
# Every established connection is between processes of the frozen tree
# (capture refuses others), so no packet can reach them mid-dump: the network
# lock, which needs iptables or nftables, is not needed.
TCP_FLAGS = ("--tcp-established", "--network-lock", "skip")
# A unit of a workload spread over several hosts holds connections to the other hosts' units:
# CRIU's network lock (iptables rules for each connection, in the host's network namespace)
# keeps this side silent while its peer is being dumped or restored, so the peer's kernel
# never answers a probe from it with a reset.
PEER_TCP_FLAGS = ("--tcp-established", "--network-lock", "iptables")
SHARED_DIR = "coldsnap-shared"
log = logging.getLogger(__name__)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"


def output_resource(root_pid: int) -> str | None:
    """The regular file the root writes its stdout to, in CRIU's spelling (no leading '/')."""
    for fd, target in fd_targets(root_pid):
        if fd == 1 and target.startswith("/") and os.path.isfile(target):
            return target.lstrip("/")
    return None


def remap_dirs(paths: list[str]) -> set[Path]:
    """Where CRIU's link remaps of deleted files (``--link-remap``) can appear during a dump of a
    tree using the shared-memory files *paths*: /dev/shm and their folders."""
    return {Path("/dev/shm")} | {Path(p).parent for p in paths}


def listing(dirs: set[Path]) -> set[Path]:
    """The entries of *dirs* now (compared before and after a dump: what CRIU left)."""
    out: set[Path] = set()
    for d in dirs:
        try:
            out.update(d / n for n in os.listdir(d) if n.startswith("link_remap."))
        except OSError:
            continue
    return out


def tcp_flags(unit: UnitImage) -> tuple[str, ...]:
    """CRIU's options for the unit's established connections (none: it had none)."""
    if not unit.tcp_established:
        return ()
    return PEER_TCP_FLAGS if unit.driver_data.peer_connections else TCP_FLAGS


def dump(
    criu: Criu, root_pid: int, images: Path, *, unit: str, host: str, driver: str, progress: Progress, leave_running: bool = False,
    peers: bool = False,
) -> UnitImage:  # fmt: skip
    """Dump the tree at *root_pid* into *images*; on success the tree is gone unless *leave_running*.

    *peers*: the tree holds connections to units on other hosts, dumped at the same cut."""
    images.mkdir(parents=True, exist_ok=True)
    pids = tuple(tree_pids(root_pid))
    root = psutil.Process(root_pid)
    born, uid = root.create_time(), root.uids().real
    shared = shared_memory_files(root_pid)
    tcp = tree_inspect.established_inside(root_pid)
    to_peers = peer_lock.to_other_hosts(connections.held_connections(pids)) if peers and tcp else []
    listening = tree_inspect.listening_ports(root_pid)
    resource = output_resource(root_pid)
    dirs = remap_dirs(shared)
    before = listing(dirs)
    args = ["dump", "-t", str(root_pid), "-D", str(images), "-o", DUMP_LOG, *BASE_FLAGS, *((PEER_TCP_FLAGS if peers else TCP_FLAGS) if tcp else ())]
    if leave_running:
        args.append("--leave-running")
    progress("criu dump of %d processes" % len(pids))
    before_dump = stopped_pids(pids)
    done = criu.run(args, timeout=1800, what="criu dump")
    if done.returncode != 0:
        # A CRIU that did not finish (killed) leaves the link-remap files it made: they would
        # make the next dump of the same tree fail ("File exists").
        for leftover in listing(dirs) - before:
            leftover.unlink(missing_ok=True)
        state = resume_after_failed_dump(pids, already_stopped=before_dump)
        raise CheckpointFailed("criu dump of pid %d %s: %s" % (root_pid, how_it_ended(done.returncode), log_tail(images / DUMP_LOG)), tree_running=state.running, state=state)
    remaps = sorted(listing(dirs) - before)
    saved = save_shared(images, [Path(p) for p in shared] + remaps, owner_gone=not leave_running)
    if not leave_running:
        # The tree's multiprocessing resource tracker died with it, before unlinking the
        # semaphores it was left (those no process holds any more): each would stay in /dev/shm.
        remove_leaked_semaphores(since=born, uid=uid)
    image = unit_image(criu, images, unit=unit, host=host, driver=driver, pids=pids, resource=resource, saved=saved, tcp=tcp, listening=listening)
    if not (peers and tcp):
        return image
    # The connections to other hosts' units, each host's restore holds back until every end is back.
    return image.model_copy(update={"driver_data": DriverData(peer_connections=True, peer_tcp=tuple(to_peers))})


def unit_image(
    criu: Criu, images: Path, *, unit: str, host: str, driver: str, pids: tuple[int, ...], resource: str | None, saved: list[SharedFile], tcp: bool,
    listening: tuple[int, ...],
) -> UnitImage:  # fmt: skip
    """What a dump recorded about the tree (*pids*, root first, as the images number them)."""
    size = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
    return UnitImage(
        name=unit,
        host=host,
        driver=driver,
        root_pid=pids[0],
        pids=pids,
        pid_namespace=False,
        log_resource=resource,
        shared_files=tuple(saved),
        tcp_established=tcp,
        listening_ports=listening,
        image_bytes=size,
        criu_version=criu.version,
    )


class CheckpointFailed(CaptureError):
    """A dump that did not finish; says whether the tree it was dumping still runs."""

    def __init__(self, message: str, *, tree_running: bool, state: TreeState | None = None) -> None:
        super().__init__(message if state is None else "%s; %s" % (message, state.describe()))
        self.tree_running = tree_running
        self.tree_state = None if state is None else state.describe()


@dataclass(frozen=True)
class TreeState:
    alive: int
    total: int
    resumed: int

    @property
    def running(self) -> bool:
        return self.alive == self.total

    def describe(self) -> str:
        if self.alive == 0:
            return "the process tree is gone"
        if self.alive < self.total:
            return "%d of the tree's %d processes are gone" % (self.total - self.alive, self.total)
        return "the process tree is still running%s" % (" (%d resumed from a stop)" % self.resumed if self.resumed else "")


def stopped_pids(pids: tuple[int, ...]) -> set[int]:
    """Which of *pids* are stopped already (a failed dump resumes only the ones it stopped)."""
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                out.add(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def resume_after_failed_dump(pids: tuple[int, ...], *, already_stopped: set[int]) -> TreeState:
    """What a dump that ended early left of the tree, with any process it left stopped resumed.

    CRIU seizes the tree with ptrace; when CRIU is killed the kernel detaches the tracees,
    but a task caught in a group stop stays stopped: it is continued, unless it was
    stopped before the dump began.
    """
    alive = resumed = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            status = p.status()
        except psutil.NoSuchProcess:
            continue
        if status == psutil.STATUS_ZOMBIE:
            continue
        alive += 1
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) and pid not in already_stopped:
            try:
                os.kill(pid, signal.SIGCONT)
                resumed += 1
            except ProcessLookupError:
                alive -= 1
    return TreeState(alive=alive, total=len(pids), resumed=resumed)


def save_shared(images: Path, files: list[Path], *, owner_gone: bool, view: str = "") -> list[SharedFile]:
    """Copy shared-memory files into the images; remove them when their tree is gone.

    *view*: the prefix the files were read through (``/proc/<pid>/root`` for a tree in a mount
    namespace of its own); they are recorded by the name the tree uses."""
    out = []
    target = images / SHARED_DIR
    target.mkdir(exist_ok=True)
    for i, path in enumerate(files):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        stored = "%s/%03d-%s" % (SHARED_DIR, i, path.name)
        copy_sparse(path, images / stored)
        out.append(SharedFile(path=str(path)[len(view) :], size=st.st_size, mode=st.st_mode & 0o7777, stored=stored))
        if owner_gone or path.name.startswith("link_remap."):
            # The content now lives in the capsule (and link-remap files are CRIU's own).
            path.unlink(missing_ok=True)
    (target / "index.json").write_text(json.dumps([f.model_dump() for f in out], indent=1))
    return out


def pid_problems(pids: tuple[int, ...], *, zombie_wait: float = 5.0) -> list[str]:
    """Captured host PIDs that some process (even a zombie) holds now.

    A zombie of a just-stopped workload is usually reaped within a second or
    two by the host's init: it is given *zombie_wait* seconds before it counts.
    """
    deadline = time.monotonic() + zombie_wait
    while True:
        held = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                held.append((pid, p.name(), p.status()))
            except psutil.NoSuchProcess:
                continue
        if not held or any(status != psutil.STATUS_ZOMBIE for _, _, status in held) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return ["captured PID %d is taken by %s (%s): restore needs it free; stop that process" % held_pid for held_pid in held]


def await_pids_free(pids: tuple[int, ...], *, timeout: float = 15.0) -> None:
    """Give the captured PIDs *timeout* seconds to come free: the workload a restore replaces
    was stopped just before it (by the plugin, or by sparkrun's own eviction), and a stopped
    process keeps its PID until it has exited and its parent (often the host's init) reaps it.
    What still holds one after that is left for ``criu restore`` to refuse."""
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def restore_problems(unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
    """What on this host stops *unit* from coming back: its captured PIDs (a tree restored
    into the host PID namespace needs them free) and its shared files in use; what the
    processes in *replacing* (the workload being replaced, stopped before the restore) hold
    is not in the way."""
    pids = tuple(p for p in unit.pids if p not in replacing)
    return ([] if unit.pid_namespace else pid_problems(pids)) + shared_file_problems(unit, replacing=replacing)


def shared_file_problems(unit: UnitImage, *, replacing: frozenset[int] = frozenset()) -> list[str]:
    paths = {f.path for f in unit.shared_files}
    return ["%s is in use by pid %s: stop that workload before restoring this capsule" % (path, ", ".join(who)) for path, who in sorted(users_of(paths, exclude=replacing).items())]


def _place_shared(unit: UnitImage, images: Path) -> list[Path]:
    placed = []
    for f in unit.shared_files:
        dst = Path(f.path)
        copy_sparse(images / f.stored, dst, mode=f.mode)
        placed.append(dst)
    return placed


def _stop_partly_restored(pids: tuple[int, ...], *, before: set[int], settle: float = 3.0) -> None:
    """Kill what a CRIU restore that did not finish (killed, or failed late) brought back.

    Such processes sit on the captured PIDs, which admission found free: one that was there
    before this restore began (*before*) is someone else's and is left alone. A half-restored
    task may still fork the rest of its tree after CRIU is gone, so this repeats until none
    is left running (or *settle* seconds).
    """
    deadline = time.monotonic() + settle
    while True:
        alive = []
        for pid in pids:
            if pid in before:
                continue
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    alive.append(pid)
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def lazy_pages_supported(criu: Criu) -> bool:
    """Can this kernel and CRIU restore memory on demand (userfaultfd)?"""
    if not settings.current().lazy_pages:
        return False
    return _uffd(criu.argv)


@functools.lru_cache(maxsize=4)
def _uffd(argv: tuple[str, ...]) -> bool:
    return run([*argv, "check", "--feature", "uffd-noncoop"], timeout=60, check=False).returncode == 0


def start_lazy_daemon(criu: Criu, images: Path, owned_dir: Path | None) -> subprocess.Popen:
    """``criu lazy-pages`` serving *images*, then removing *owned_dir* once every page is delivered.

    It outlives this process (its own session): the restored tree depends on it
    until the last page has moved, which it does in the background.
    """
    socket_path = images / "lazy-pages.socket"
    socket_path.unlink(missing_ok=True)
    log_path = paths.run_dir() / "logs" / ("lazy-pages-%d.log" % os.getpid())
    log_path.parent.mkdir(parents=True, exist_ok=True)
    script = '"$@"; rc=$?; [ -n "$COLDSNAP_REMOVE" ] && rm -rf -- "$COLDSNAP_REMOVE"; exit $rc'
    env = settings.current().child_env(COLDSNAP_REMOVE=str(owned_dir) if owned_dir else "")
    daemon = subprocess.Popen(
        ["sh", "-c", script, "lazy-pages", *criu.argv, "lazy-pages", "-D", str(images), "-o", str(log_path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not socket_path.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            stop_lazy_daemon(daemon)
            raise RestoreError("criu lazy-pages did not start: %s" % log_tail(log_path))
        time.sleep(0.005)
    return daemon


def stop_lazy_daemon(daemon: subprocess.Popen) -> None:
    """Kill a lazy-pages daemon that will serve no restore, with its session."""
    try:
        os.killpg(daemon.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    daemon.wait()


def restore(
    criu: Criu, unit: UnitImage, images: Path, *, log_path: Path, progress: Progress, lazy: bool = False, owned_dir: Path | None = None,
    extra_args: tuple[str, ...] = (), details: dict[str, Any] | None = None,
) -> tuple[int, bool]:  # fmt: skip
    """Restore *unit* detached; returns the host PID of its root and whether *owned_dir* was handed over.

    With *lazy*, memory pages are not copied before the tree resumes: a
    ``criu lazy-pages`` daemon fills them on first touch and streams the rest
    in the background, then removes *owned_dir* (the staged images).

    CRIU leaves the tree stopped: images split for a fill
    (:mod:`sparkrun_coldsnap.criu.page_fill`) get the pages it took out written then, and
    every process asks again for the AMX tile permission CRIU does not restore
    (:mod:`sparkrun_coldsnap.host.xstate_perm`) before any of it runs; then it is continued.
    *details* receives the timings.
    """
    filling = page_fill.fill_planned(images)
    lazy = lazy and not filling  # the fill writes every page before the tree runs
    pidfile = paths.restore_pidfile(unit.name)
    pidfile.unlink(missing_ok=True)
    if not unit.pid_namespace:
        await_pids_free(unit.pids)
    occupied = {pid for pid in unit.pids if psutil.pid_exists(pid)}
    t_files = time.monotonic()
    placed = _place_shared(unit, images)
    log.debug("placed %d shared files in %.3f s", len(placed), time.monotonic() - t_files)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    daemon = None
    try:
        inherit = ["--inherit-fd", "fd[%d]:%s" % (log_fd, unit.log_resource)] if unit.log_resource else []
        args = ["restore", "-d", "-D", str(images), "-o", RESTORE_LOG, "--pidfile", str(pidfile), *BASE_FLAGS]
        args += list(tcp_flags(unit)) + inherit + list(extra_args)
        if lazy:
            daemon = start_lazy_daemon(criu, images, owned_dir)
            args.append("--lazy-pages")
        # Stopped on every path, with memory on demand too: no process may run before it has
        # asked again for its AMX permission (a tile instruction without it is SIGILL).
        args.append("--leave-stopped")
        progress("criu restore%s" % (" (memory on demand)" if lazy else ""))
        t, faults = time.monotonic(), major_faults.of_children()
        done = criu.run(args, timeout=1800, pass_fds=(log_fd,), what="criu restore")
        log.debug("criu restore took %.3f s", time.monotonic() - t)
        if details is not None:
            details["criu_restore_seconds"] = round(time.monotonic() - t, 4)
            # Pages CRIU itself had to wait for from the disk: none where preparation read its files.
            details["criu_restore_major_faults"] = major_faults.of_children() - faults
    finally:
        os.close(log_fd)
    if done.returncode != 0:
        if daemon is not None:
            stop_lazy_daemon(daemon)
        for p in placed:
            p.unlink(missing_ok=True)
        _stop_partly_restored(unit.pids, before=occupied)
        raise RestoreError("criu restore of unit %s %s (after %.1f s): %s" % (unit.name, how_it_ended(done.returncode), time.monotonic() - t, log_tail(images / RESTORE_LOG)))
    if daemon is not None and owned_dir is not None and daemon.poll() is not None:
        # A small tree's pages can all be delivered before criu restore has finished writing
        # its statistics there: the daemon's removal then raced it, so remove again.
        paths.remove_staging(owned_dir)
    try:
        root = int(pidfile.read_text().strip())
    except (OSError, ValueError) as err:
        # The tree came back with its captured PIDs: stop it rather than leave it unowned.
        if unit.pids and psutil.pid_exists(unit.pids[0]):
            kill_tree(unit.pids[0], grace=2.0)
        raise RestoreError("criu restore of unit %s reported success but wrote no pidfile: %s" % (unit.name, err)) from err
    finally:
        pidfile.unlink(missing_ok=True)
    continue_restored(unit, images, root, filling=filling, progress=progress, details=details)
    return root, daemon is not None and owned_dir is not None


def continue_restored(unit: UnitImage, images: Path, root_pid: int, *, filling: bool, progress: Progress, details: dict[str, Any] | None) -> None:
    """Finish the tree CRIU left stopped and let it run: write the pages the split took out of
    *images* (with *filling*), give its processes back their AMX tile permission, continue it.
    A fill that fails, or a process that does not stop, ends the tree (it would run with zeros
    for memory, or before it could use the tiles)."""
    try:
        if filling:
            threads = max(1, settings.current().page_fill_threads)
            progress("page fill of %.1f GB of memory, %d threads" % (page_fill.planned_bytes(images) / 1e9, threads))
            report = page_fill.fill(images, root_pid, threads=threads)
            log.debug("page fill wrote %d bytes into %d processes in %.3f s with %d threads", report.bytes, report.processes, report.seconds, report.threads)
            if details is not None:
                details["page_fill"] = report.to_json()
        else:
            page_fill.await_stopped(tree_pids(root_pid))
    except BaseException as err:
        kill_tree(root_pid, grace=0.0)
        if isinstance(err, (OSError, ValueError, KeyError)):
            raise RestoreError("the memory fill of unit %s failed: %s" % (unit.name, err)) from err
        raise
    # Every thread is in its stop now (both branches waited for it): none can reach a tile
    # instruction before its process has asked again.
    xstate_perm.give_back_tiles(root_pid, unit_name=unit.name, details=details)
    # A unit of a workload on several hosts was dumped stopped at the cut: it comes back
    # stopped either way, and the coordinator continues every unit at once.
    if unit.driver_data.peer_connections:
        return
    continue_tree(root_pid)
