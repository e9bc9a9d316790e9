"""Hibernate: capture the LIVE workload into a capsule (no fresh engine start), then stop it.

The same story as a capture from the point the engine serves (validate, write the native
weights, release device memory, precheck, record files, checkpoint, pack, publish), told
against the running tree sparkrun has registered instead of one the capture starts. What
differs is what a failure leaves: the workload. Nothing here ever stops it before the
capsule is published; a failed checkpoint leaves it running (CRIU resumes the tree), and on
GPUs memory released for the checkpoint is taken back.
"""

from __future__ import annotations

import time
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.config import NativePayload
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.capture import CaptureOutcome, CaptureRun, _checkpoint_at_capture_point, package
from sparkrun_coldsnap.controller.common import Attempt, finish, require_one_unit, resolve
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import CaptureRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, RequestError
from sparkrun_coldsnap.host import engine_temp
from sparkrun_coldsnap.host.facts import host_facts
from sparkrun_coldsnap.launch.local import StartedUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.weights import model_files, weight_paths


def hibernate(
    req: CaptureRequest, *, root_pid: int, log_path: Path, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET,
    native: NativePayload | None = None,
) -> CaptureOutcome:  # fmt: skip
    """Capture the workload serving at *root_pid* into capsule ``req.capsule`` of *store*, then stop
    it; *native* is the payload of the capsule it came back from, kept if still intact."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("hibernate", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    rb.secrets = req.workload.secret_values()
    rb.details["root_pid"] = root_pid
    w = req.workload
    # Attempt.running stays None: a failure must never stop the workload being hibernated.
    with settings_mod.using(settings), Attempt(rb):
        with rb.phase("admission"):
            require_one_unit(w, "capture")
            r = resolve(w, settings)
            support = r.driver.support(host_facts())
            if not support.ok:
                raise CaptureError("snapshot driver %s cannot capture on this host: %s" % (r.driver.name, support.reason))
            r.launcher.check_capturable()
            if w.launch.executor != "local":
                raise RequestError("hibernate runs on host-process workloads (executor local); this one runs with executor %s" % w.launch.executor)
            if not w.model.path:
                raise RequestError("the pinned snapshot of %s@%s is not in the model cache: the capsule is bound to its files" % (w.model.id, w.model.revision))
            store.init()
        with rb.phase("model_digests"):
            recorded_files = model_files.record(Path(w.model.path))
        unit = StartedUnit(root_pid, None, log_path)
        endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
        with store.staging_dir("hibernate-") as staging:
            unit_def = w.topology.units[0]
            run = CaptureRun(
                req, r, settings, rb, progress, unit_def, log_path, staging / "units" / unit_def.name, endpoint, unit, time.monotonic(),
                weight_paths.writes_native(w, r.driver, r.adapter), store, live=True, native_reuse=native,
            )  # fmt: skip
            try:
                image, validation, native = _checkpoint_at_capture_point(run)
            except ColdsnapError as err:
                _give_memory_back(run, err)
                raise
            with rb.phase("stop"):
                unit.stop(grace=10.0)  # what the checkpoint left of the tree (CRIU ended it already)
            engine_temp.sweep(keep=frozenset(f.path for f in image.files))
            desc = package(run, staging, image, validation, native, recorded_files)
        rb.capsule = desc.digest
        return CaptureOutcome(finish(rb, None), capsule_mod.open_capsule(store, req.capsule.ref))


def _give_memory_back(run: CaptureRun, err: ColdsnapError) -> None:
    """After a failed checkpoint, a tree that still runs gets back the device memory it released for it."""
    released = "release_memory" in {p.name for p in run.rb.phases}
    if not released or not run.unit.alive():
        run.rb.details["workload_state"] = "running" if run.unit.alive() else "gone"
        return
    try:
        with run.rb.phase("wake_after_failure"):
            run.r.adapter.wake(run.endpoint, 2, model_dir=run.req.workload.model.path or "")
        run.rb.details["workload_state"] = "running"
    except ColdsnapError as wake_err:
        run.rb.details["workload_state"] = "running, its memory released"
        err.args = ("%s; waking it again also failed: %s" % (err.message, wake_err),)
