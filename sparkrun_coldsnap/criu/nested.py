"""CRIU dump of a tree that was restored into namespaces of its own (hibernating it).

A tree restored by :mod:`sparkrun_coldsnap.criu.isolated` lives in a PID, mount and
network namespace whose init is not part of it. CRIU run from the host refuses a tree in
another PID namespace unless it dumps that namespace's init too, and would then record the
namespaces. Run inside them instead (``nsenter`` into the init's namespaces), CRIU sees the
tree exactly as the capture that made its capsule saw it in the host's: the captured PIDs,
``/dev/shm`` names and port. So the images are those of an ordinary capture, and restore
(again into namespaces of its own) needs nothing new.

Two things differ from a dump in the host's namespaces:

* the tree's ``/dev/shm`` is the namespace's tmpfs: its files are read through
  ``/proc/<root>/root`` (the tree's own view of its mounts);
* when the tree ends, its namespace's init ends and takes every process in the namespace with
  it, CRIU included. So CRIU leaves the tree stopped (``--leave-stopped``), the shared files
  are saved, and only then is the tree killed.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu import tree_inspect
from sparkrun_coldsnap.criu.tool import Criu, how_it_ended, log_tail
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.host.process_tree import SHARED_MEMORY_DIRS, fd_targets, inner_pid, kill_tree, mapped_paths, tree, tree_pids
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.progress import Report as Progress


def namespace_init(root_pid: int) -> int | None:
    """The init of the PID namespace *root_pid* was restored into, when it was (else None)."""
    try:
        p = psutil.Process(root_pid)
        init = p.parent()
        if init is None:
            return None
        with open("/proc/%d/status" % init.pid) as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    except (OSError, psutil.Error):
        return None
    # The init is PID 1 of a namespace below the host's: it has two NSpid entries, the last 1.
    return init.pid if len(nspid) >= 2 and nspid[-1] == "1" else None


def _shared_files(root_pid: int, view: str) -> list[str]:
    """Files on shared-memory filesystems the tree uses, as the tree names them."""
    out: set[str] = set()
    for p in tree(root_pid):
        for path in {t for _, t in fd_targets(p.pid)} | mapped_paths(p.pid):
            if path.startswith(SHARED_MEMORY_DIRS) and not path.endswith(" (deleted)") and Path(view + path).is_file():
                out.add(path)
    return sorted(out)


def dump(criu: Criu, root_pid: int, init_pid: int, images: Path, *, unit: str, host: str, driver: str, progress: Progress) -> UnitImage:
    """Dump the tree at host PID *root_pid*, restored under the namespace init *init_pid*; on success the tree is gone."""
    images.mkdir(parents=True, exist_ok=True)
    view = "/proc/%d/root" % root_pid
    host_pids = tuple(tree_pids(root_pid))
    pids = tuple(inner_pid(p) for p in host_pids)
    shared = _shared_files(root_pid, view)
    tcp = tree_inspect.established_inside(root_pid)
    listening = tree_inspect.listening_ports(root_pid)
    resource = criu_tree.output_resource(root_pid)
    dirs = {Path(view + str(d)) for d in criu_tree.remap_dirs(shared)}
    before = criu_tree.listing(dirs)
    # The images are reached through a descriptor: a path under the host's /dev/shm would name the namespace's.
    fd = os.open(images, os.O_RDONLY | os.O_DIRECTORY)
    try:
        args = ["dump", "-t", str(pids[0]), "-D", "/proc/self/fd/%d" % fd, "-o", criu_tree.DUMP_LOG, "--leave-stopped", *criu_tree.BASE_FLAGS]
        args += list(criu_tree.TCP_FLAGS if tcp else ())
        progress("criu dump of %d processes inside their namespaces" % len(pids))
        before_dump = criu_tree.stopped_pids(host_pids)
        nsenter = ["nsenter", "--target", str(init_pid), "--pid", "--mount", "--net", "--"]
        done = run([*nsenter, *criu.argv, *args], timeout=1800, check=False, pass_fds=(fd,), what="criu dump (in the tree's namespaces)")
    finally:
        os.close(fd)
    if done.returncode != 0:
        for leftover in criu_tree.listing(dirs) - before:
            leftover.unlink(missing_ok=True)
        state = criu_tree.resume_after_failed_dump(host_pids, already_stopped=before_dump)
        raise criu_tree.CheckpointFailed(
            "criu dump of pid %d (in its own namespaces) %s: %s" % (root_pid, how_it_ended(done.returncode), log_tail(images / criu_tree.DUMP_LOG)),
            tree_running=state.running,
            state=state,
        )
    remaps = sorted(criu_tree.listing(dirs) - before)
    try:
        saved = criu_tree.save_shared(images, [Path(view + p) for p in shared] + remaps, owner_gone=True, view=view)
    finally:
        kill_tree(root_pid, grace=0.0)  # stopped by CRIU: nothing to shut down gracefully
    return criu_tree.unit_image(criu, images, unit=unit, host=host, driver=driver, pids=pids, resource=resource, saved=saved, tcp=tcp, listening=listening)
