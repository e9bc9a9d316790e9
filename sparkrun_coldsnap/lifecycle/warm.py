"""Warm: prepare a restore ahead of time, so a later ``wake`` or ``sparkrun run`` only activates.

A restore's preparation (open and verify the capsule, admission, unpack every layer, read the
weights the restore will read into the page cache) is what takes the time before the old
workload stops. Done ahead and kept on disk (in memory where there is room: the host's
``/dev/shm``), it survives the command that made it; the next activation runs admission again
(the host may have changed since) and restores straight from the kept images.

The kept images live outside the store's staging area (``gc`` reclaims that by owner PID) in a
directory named after the workload. They are released by ``sparkrun coldsnap stop``, by
activation (the restore consumes them), or when their time is up: every lifecycle command
releases expired ones first. Nothing runs in the background to do it.

Where the restore is followed by hydration (a GPU driver whose weights come back from the
model files or the native payload, a host-process unit), warm goes one step further: it
restores the process tree ahead. The tree comes back as it was captured, with its GPU state
and its engine asleep (weights and KV cache released), recorded as sparkrun's workload under
its name (``sparkrun status`` lists it, ``sparkrun stop`` ends it), and a later activation only
hydrates the weights and validates. The tree's identity (PID and start time) is kept beside
the staging directory at once, so releasing the staging ends the tree too, whoever releases it
(``warm --release``, its time running out, an activation that failed, the next warm). It holds
what an asleep engine holds (its port, host memory, the GPU memory the release left);
``--images-only`` keeps the images alone instead, and a port already in use does the same.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import time
from pathlib import Path

import psutil

from sparkrun_coldsnap.api import Attempt, HereRestore, PreparedRestore, Resolved, finish, open_and_admit, prepare_restore, unpack_capsule, unpacked_size
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host import disk_room
from sparkrun_coldsnap.host.ports import port_holder
from sparkrun_coldsnap.host.process_tree import kill_tree, start_ticks, tree_pids
from sparkrun_coldsnap.launch.host_processes import RestoredTree
from sparkrun_coldsnap.lifecycle.records import WarmRestore
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.weights import page_cache
from sparkrun_coldsnap.weights.weight_paths import WeightChoice

WARM_DIR = "coldsnap-warm"


def warm_root(store: CapsuleStore, settings: Settings, needed_bytes: int) -> Path:
    """In memory when it has room for twice the images (as restore staging), else beside the store."""
    memory = settings.memory_staging
    if memory is not None and memory.is_dir():
        try:
            if disk_room.free_bytes(memory) >= 2 * needed_bytes:
                return memory / WARM_DIR
        except OSError:
            pass
    return store.root / "warm"


def prepare_ahead(
    req: RestoreRequest, *, workload: str, store: CapsuleStore, settings: Settings | None = None, keep_seconds: float, progress: Progress = QUIET,
    images_only: bool = False,
) -> tuple[WarmRestore, Receipt]:  # fmt: skip
    """Open, admit and unpack capsule ``req.capsule`` into a kept directory; read its weights into
    the page cache; where hydration follows the restore, restore the tree ahead too."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("warm", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    tree_pid = None
    with settings_mod.using(settings), Attempt(rb) as attempt:
        cap, r, choice, _ = open_and_admit(req, store, settings, rb)
        staging = warm_root(store, settings, unpacked_size(cap)) / workload
        release_dir(staging)  # what an interrupted warm of this workload left (its tree too)
        staging.mkdir(parents=True)
        attempt.on_failure(lambda: release_dir(staging))
        unpack_capsule(store, cap, staging, rb, progress)
        cached = False
        if choice is not None:
            cached = page_cache.cache_for_restore(cap.config, choice, req.workload.model.path, rb, progress, enabled=settings.weights_cache).cached
        if not images_only:
            why_not = tree_ahead_refused(req, r, choice)
            if why_not is None:
                tree_pid = restore_tree_ahead(req, cap, r, staging, workload, rb, progress)
            else:
                rb.details["tree_not_restored"] = why_not
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=keep_seconds)
    image = cap.config.units[0]
    warm = WarmRestore(
        capsule_ref=req.capsule.ref, capsule_digest=cap.digest, staging=str(staging), images=str(staging / "units" / image.name),
        weights_cached=cached, expires_at=expires.isoformat(timespec="seconds"), tree_pid=tree_pid,
    )  # fmt: skip
    rb.details["staging"] = str(staging)
    rb.details["expires_at"] = warm.expires_at
    return warm, finish(rb, None)


def tree_ahead_refused(req: RestoreRequest, r: Resolved, choice: WeightChoice | None) -> str | None:
    """Why the tree is not restored ahead (None: it is)."""
    if choice is None:
        return "the %s driver's restore brings the weights back inside the images: restored ahead the workload would be serving, not warm" % r.driver.name
    if req.workload.launch.executor != "local":
        return "a %s unit is restored by its runtime at activation" % req.workload.launch.executor
    holder = port_holder(req.workload.launch.port)
    if holder:
        return "port %d is in use by %s" % (req.workload.launch.port, holder)
    return None


def restore_tree_ahead(req: RestoreRequest, cap: Capsule, r: Resolved, staging: Path, workload: str, rb: ReceiptBuilder, progress: Progress) -> int:
    """Restore the unit's tree from *staging* (engine asleep, GPU state back), record it as
    sparkrun's workload and beside the staging; its root PID."""
    from sparkrun_coldsnap.integration.records import local_record_paths, register_local

    image = cap.config.units[0]
    with rb.phase(r.launcher.stage_phase):
        staged = r.launcher.stage(r.driver, image, staging / "units" / image.name, staging=staging, request=req)
    _, log_path = local_record_paths(workload)
    try:
        with rb.phase("restore"), progress.waiting("restoring the process tree ahead (the engine stays asleep)"):
            running = staged.activate(workload, log_path=log_path, progress=progress.step)
        try:
            _write_tree(staging, running.root_pid)  # first: from here releasing the staging ends the tree
            register_local(workload, running.root_pid)
        except BaseException:
            running.stop()
            raise
    finally:
        staged.discard()  # the images are consumed; the tree is what is kept
    rb.details["tree_pid"] = running.root_pid
    return running.root_pid


def _tree_file(staging: Path) -> Path:
    return staging.with_name(staging.name + ".tree")


def _write_tree(staging: Path, pid: int) -> None:
    _tree_file(staging).write_text(json.dumps({"pid": pid, "start_ticks": start_ticks(pid)}) + "\n")


def tree_alive(warm: WarmRestore) -> bool:
    """Whether the tree restored ahead for *warm* still runs (False when none was)."""
    return warm.tree_pid is not None and _recorded_tree(Path(warm.staging)) == warm.tree_pid


def _recorded_tree(staging: Path) -> int | None:
    """The root recorded beside *staging* if that very process still runs."""
    try:
        doc = json.loads(_tree_file(staging).read_text())
        p = psutil.Process(int(doc["pid"]))
        if "start_ticks" in doc:
            same = start_ticks(p.pid) == int(doc["start_ticks"])
        else:  # recorded by an earlier version, in seconds of the wall clock
            same = abs(p.create_time() - float(doc["started"])) < 1.0
        if same and p.status() != psutil.STATUS_ZOMBIE:
            return p.pid
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    return None


def claim(warm: WarmRestore, req: RestoreRequest, *, store: CapsuleStore, settings: Settings, workload: str, progress: Progress = QUIET) -> PreparedRestore:
    """The kept restore of *workload* as a prepared one (admission runs again; nothing is
    unpacked): the images, or the tree restored ahead, which activation then only hydrates and
    validates, under the run's name (``req.workload_name``)."""
    if req.capsule.ref != warm.capsule_ref:
        req = req.model_copy(update={"capsule": req.capsule.with_tag(CapsuleRef.parse(warm.capsule_ref).tag)})
    if warm.tree_pid is None:
        return prepare_restore(req, store=store, settings=settings, progress=progress, staged_at=Path(warm.staging))
    if not tree_alive(warm):
        raise RestoreError("the process tree restored ahead (pid %d) is gone" % warm.tree_pid)
    rb = ReceiptBuilder("restore", request_sha256=req.digest())
    rb.capsule_ref, rb.secrets = req.capsule.ref, req.workload.secret_values()
    t = time.monotonic()
    with settings_mod.using(settings):
        # What the tree holds (its PIDs, its shared files) is the workload's own.
        cap, r, choice, _ = open_and_admit(req, store, settings, rb, replacing=frozenset(tree_pids(warm.tree_pid)))
    rb.details["restored_ahead"] = True
    from sparkrun_coldsnap.integration.records import adopt_log, local_record_paths, register_local, unregister_local

    if workload != req.workload_name:
        # A status-aware scheduler named this run anew, and sparkrun stops the deployments of
        # the same intent under other names just before the activation: the tree takes the
        # run's name now (its output keeps going to its log, which the new name's links to).
        register_local(req.workload_name, warm.tree_pid)
        unregister_local(workload)
        adopt_log(workload, req.workload_name)
    staged = RestoredTree(
        warm.tree_pid, local_record_paths(workload)[1], on_handover=lambda: _tree_file(Path(warm.staging)).unlink(missing_ok=True),
    )  # fmt: skip
    return PreparedRestore(req, cap, r, settings, rb, HereRestore(staged=staged), prepare_seconds=time.monotonic() - t, weights=choice, restored_ahead=True)


def expired(warm: WarmRestore) -> bool:
    return dt.datetime.fromisoformat(warm.expires_at) <= dt.datetime.now(dt.UTC)


def release_dir(staging: str | Path) -> None:
    """Remove a kept staging directory, ending the tree restored ahead from it if it still runs
    (and the parent folder in memory once it is empty)."""
    path = Path(staging)
    pid = _recorded_tree(path)
    if pid is not None:
        kill_tree(pid, grace=10.0)
    _tree_file(path).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    if path.parent.name == WARM_DIR:
        try:
            path.parent.rmdir()
        except OSError:
            pass
