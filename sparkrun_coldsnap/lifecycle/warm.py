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

What ``warm`` does not do yet, on any driver: restore the process tree ahead. On ``n610`` that
would bring the tree and its GPU state back with the weights not yet hydrated; it is not built.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.common import Attempt, finish
from sparkrun_coldsnap.controller.restore import PreparedRestore, open_and_admit, prepare_restore, unpack_capsule, unpacked_size
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.host import disk_room
from sparkrun_coldsnap.lifecycle.records import WarmRestore
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.weights import page_cache

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
) -> tuple[WarmRestore, Receipt]:  # fmt: skip
    """Open, admit and unpack capsule ``req.capsule`` into a kept directory; read its weights into the page cache."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("warm", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    with settings_mod.using(settings), Attempt(rb) as attempt:
        cap, _, choice, _ = open_and_admit(req, store, settings, rb)
        staging = warm_root(store, settings, unpacked_size(cap)) / workload
        release_dir(staging)  # what an interrupted warm of this workload left
        staging.mkdir(parents=True)
        attempt.on_failure(lambda: release_dir(staging))
        unpack_capsule(store, cap, staging, rb, progress)
        cached = False
        if choice is not None:
            cached = page_cache.cache_for_restore(cap.config, choice, req.workload.model.path, rb, progress, enabled=settings.weights_cache).cached
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=keep_seconds)
    image = cap.config.units[0]
    warm = WarmRestore(
        capsule_ref=req.capsule.ref, capsule_digest=cap.digest, staging=str(staging), images=str(staging / "units" / image.name),
        weights_cached=cached, expires_at=expires.isoformat(timespec="seconds"),
    )  # fmt: skip
    rb.details["staging"] = str(staging)
    rb.details["expires_at"] = warm.expires_at
    return warm, finish(rb, None)


def claim(warm: WarmRestore, req: RestoreRequest, *, store: CapsuleStore, settings: Settings, progress: Progress = QUIET) -> PreparedRestore:
    """The kept images as a prepared restore (admission runs again; nothing is unpacked)."""
    if req.capsule.ref != warm.capsule_ref:
        req = req.model_copy(update={"capsule": req.capsule.model_copy(update={"tag": warm.capsule_ref.rsplit(":", 1)[1]})})
    return prepare_restore(req, store=store, settings=settings, progress=progress, staged_at=Path(warm.staging))


def expired(warm: WarmRestore) -> bool:
    return dt.datetime.fromisoformat(warm.expires_at) <= dt.datetime.now(dt.UTC)


def release_dir(staging: str | Path) -> None:
    """Remove a kept staging directory (and its parent folder in memory once it is empty)."""
    path = Path(staging)
    shutil.rmtree(path, ignore_errors=True)
    if path.parent.name == WARM_DIR:
        try:
            path.parent.rmdir()
        except OSError:
            pass
