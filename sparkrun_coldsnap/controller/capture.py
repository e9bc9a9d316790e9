"""Capture: launch the engine, bring it to its capture point, checkpoint it, publish a capsule."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.pack import pack_unit
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.compat import pinning
from sparkrun_coldsnap.controller.admit import admit_driver_here, admit_snapshot
from sparkrun_coldsnap.controller.common import Attempt, finish, require_one_unit, validate, wait_ready
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, CapturedValidation, EngineRecord, ModelFile, NativePayload, WeightsRecord
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import CaptureRequest, LaunchUnit
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.base import SnapshotDriver
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, RequestError, ValidationError
from sparkrun_coldsnap.host import disk_room, engine_temp, leftovers, paths
from sparkrun_coldsnap.host.iouring import io_uring_disabled
from sparkrun_coldsnap.host.ports import port_holder
from sparkrun_coldsnap.host.process_tree import tree_pids
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved, resolve
from sparkrun_coldsnap.weights import model_files, native_payload, packed_payload, weight_paths


@dataclass
class CaptureOutcome:
    receipt: Receipt
    capsule: Capsule | None = None


@dataclass
class CaptureRun:
    """Everything one capture carries from step to step."""

    req: CaptureRequest
    r: Resolved
    settings: Settings
    rb: ReceiptBuilder
    progress: Progress
    unit_def: LaunchUnit
    log_path: Path
    images: Path
    endpoint: Endpoint
    unit: RunningUnit
    t0: float
    native_wanted: bool
    store: CapsuleStore
    #: where the capsule's layers are packed before publishing
    staging: Path
    #: the engine was already serving when the capture began (a hibernate): no launch to time from
    live: bool = False
    #: the native payload the serving engine's weights came back from, written by an earlier capture
    native_reuse: NativePayload | None = None


@dataclass(frozen=True)
class LiveWorkload:
    """An engine already serving (sparkrun's, a hibernate), captured where it runs: no launch,
    and a failure never stops it (a failed checkpoint leaves it running, its device memory
    taken back); once the capsule holds it, what the checkpoint left of it is stopped."""

    unit: RunningUnit
    log_path: Path
    #: the payload of the capsule it came back from, kept if still intact
    native: NativePayload | None = None


def capture(
    req: CaptureRequest, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET, live: LiveWorkload | None = None,
) -> CaptureOutcome:  # fmt: skip
    """Launch the engine (or take the *live* one), validate it, capture it into a capsule in *store*."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("capture" if live is None else "hibernate", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    rb.secrets = req.workload.secret_values()
    if live is not None:
        rb.details["root_pid"] = live.unit.root_pid
    w = req.workload
    # For a live workload attempt.running stays None: a failure must never stop it.
    with settings_mod.using(settings), Attempt(rb) as attempt:
        with rb.phase("admission"):
            r, model_dir = _admitted(req, settings, rb, live=live is not None)
            store.init()
        with rb.phase("model_digests"):
            recorded_files = model_files.record(model_dir)
        native_wanted = weight_paths.writes_native(w, r.driver, r.adapter)
        with contextlib.ExitStack() as stack:
            if live is None:
                run = _launched(req, r, settings, rb, progress, attempt, stack, store, native_wanted=native_wanted)
            else:
                staging = stack.enter_context(store.staging_dir("hibernate-"))
                unit_def = w.topology.units[0]
                run = CaptureRun(
                    req, r, settings, rb, progress, unit_def, live.log_path, staging / "units" / unit_def.name, r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port),
                    live.unit, time.monotonic(), native_wanted, store, staging, live=True, native_reuse=live.native,
                )  # fmt: skip
            try:
                image, validation, native = _checkpoint_at_capture_point(run)
            except ColdsnapError as err:
                if run.live:
                    _give_memory_back(run, err)
                raise
            # Past the checkpoint: a serving tree is gone (a container stopped), a template
            # served once for the reply; either way nothing of it is needed any more.
            attempt.running = None
            if run.live:
                with rb.phase("stop"):
                    run.unit.stop(grace=10.0)  # what the checkpoint left of the tree (CRIU ended it already)
            else:
                run.unit.stop(grace=10.0)
                run.unit.reap()
            engine_temp.sweep(keep=frozenset(f.path for f in image.files))  # the stopped engine's sockets and init files in /tmp
            desc = package(run, run.staging, image, validation, native, recorded_files)
        rb.capsule = desc.digest
        return CaptureOutcome(finish(rb, None), capsule_mod.open_capsule(store, req.capsule.ref))


def _admitted(req: CaptureRequest, settings: Settings, rb: ReceiptBuilder, *, live: bool) -> tuple[Resolved, Path]:
    """The workload resolved and admitted for capture on this host, before anything starts; the pinned snapshot's directory."""
    w = req.workload
    require_one_unit(w, "capture")
    if not live:
        # What a capture killed outright left (its engine on the port, io_uring off) is undone first.
        recovered = leftovers.recover()
        if recovered.stopped:
            rb.details["recovered"] = list(recovered.stopped)
    r = resolve(w, settings)
    admit_driver_here(r)
    if not live:
        holder = port_holder(w.launch.port)
        if holder:
            raise CaptureError("port %d is in use by %s: stop that workload (sparkrun stop) or capture on another port" % (w.launch.port, holder))
    r.launcher.check_capturable()
    if live and w.launch.executor != "local":
        raise RequestError("hibernate runs on host-process workloads (executor local); this one runs with executor %s" % w.launch.executor)
    return r, admit_snapshot(w, r.adapter, launches=not live)


def _launched(
    req: CaptureRequest, r: Resolved, settings: Settings, rb: ReceiptBuilder, progress: Progress, attempt: Attempt, stack: contextlib.ExitStack, store: CapsuleStore,
    *, native_wanted: bool,
) -> CaptureRun:  # fmt: skip
    """The engine started for capture with what its driver needs of the launch, io_uring off
    while it runs; the unit is *attempt*'s to stop on a failure, and a leftover until it ends."""
    w = req.workload
    command, env = r.adapter.prepare_launch(w.launch.command, r.launcher.engine_env(w, r.engine_env, settings.environ), release_weights=r.driver.needs_release, native_weights=native_wanted)
    launched = command, dict(env)
    command, env = r.driver.launch_settings(command, env, adapter=r.adapter, topology=w.topology)
    if (command, env) != launched:  # what the driver needs of the launch, for whoever reads the receipt
        rb.details["driver_launch"] = {"flags": command[len(launched[0]) :].split(), "env": {k: v for k, v in env.items() if launched[1].get(k) != v}}
    command = r.driver.launch_command(command, r.adapter, settings)
    log_path = paths.run_dir() / "logs" / ("capture-%s-%d.log" % (req.capsule.name, os.getpid()))
    log_path.unlink(missing_ok=True)
    unit_def = w.topology.units[0]
    stack.enter_context(io_uring_disabled())
    staging = stack.enter_context(store.staging_dir("capture-"))
    progress.step("starting %s for capture (%s, driver %s)" % (w.engine, req.capsule.ref, r.driver.name))
    with rb.phase("launch"):
        t0 = time.monotonic()
        unit = attempt.running = r.launcher.start(w, command, env, log_path=log_path, name="coldsnap-capture-%s" % req.capsule.name)
    leftovers.adopt(unit.root_pid, "the engine of a capture of %s" % req.capsule.ref)
    stack.callback(leftovers.release, unit.root_pid)
    return CaptureRun(
        req, r, settings, rb, progress, unit_def, log_path, staging / "units" / unit_def.name,
        r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port), unit, t0, native_wanted, store, staging,
    )  # fmt: skip


def _give_memory_back(run: CaptureRun, err: ColdsnapError) -> None:
    """After a failed checkpoint, a live tree that still runs gets back the device memory it released for it."""
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


def package(run: CaptureRun, staging: Path, image: UnitImage, validation: Validation, native: NativePayload | None, recorded_files: tuple) -> Descriptor:
    """Check the model files did not change, pack the images, write the config, publish under the request's tag."""
    req, r, rb, progress, w, unit_def = run.req, run.r, run.rb, run.progress, run.req.workload, run.unit_def
    assert w.model.path
    with rb.phase("model_check"):
        # The digests recorded before the launch must still describe the files the engine read.
        changed = model_files.verify(Path(w.model.path), recorded_files)
    if changed:
        raise CaptureError("the model files changed while the engine loaded them: %s; capture again" % "; ".join(changed))
    image = _without_zero_pages(r.driver, run.images, image, rb, progress, enabled=run.settings.zero_pages)
    with rb.phase("pack"), progress.transfer("packing %.1f MB of process images" % (image.image_bytes / 1e6), image.image_bytes) as tick:
        layers = pack_unit(run.images, unit_def.name, staging, tick=tick)
    config = capsule_config(req, r, r.fingerprint(w, image.criu_version), validation, recorded_files, native, (image,))
    with rb.phase("publish"):
        desc = capsule_mod.publish(run.store, layers, config)
    rb.details["image_bytes"] = image.image_bytes
    rb.details["capsule_bytes"] = sum(layer.size for layer in layers)
    return desc


def capsule_config(
    req: CaptureRequest, r: Resolved, fingerprint: Fingerprint, validation: Validation, recorded_files: tuple[ModelFile, ...], native: NativePayload | None,
    units: tuple[UnitImage, ...],
) -> CapsuleConfig:  # fmt: skip
    """What a capsule of *units* records, one unit or several: the redacted workload, the host it
    must be restored on (*fingerprint*), the engine, the reply restores must give, the weights."""
    w = req.workload
    return CapsuleConfig(
        name=req.capsule.name,
        tag=req.capsule.tag,
        created=capsule_mod.now_iso(),
        request_sha256=req.digest(),
        workload=w.redacted(),
        fingerprint=fingerprint,
        engine=EngineRecord(name=w.engine, version=r.adapter.version(r.facts.packages) if r.facts else None),
        driver=r.driver.name,
        validation=CapturedValidation(prompt=req.validation.prompt, max_tokens=req.validation.max_tokens, reply=validation.reply or "", request_ttft_seconds=validation.request_ttft_seconds),
        weights=WeightsRecord(location="in-image" if r.driver.weights_in_image else "external", model_id=w.model.id, revision=w.model.revision, files=recorded_files, native=native),
        units=units,
    )


def _without_zero_pages(driver: SnapshotDriver, images: Path, image: UnitImage, rb: ReceiptBuilder, progress: Progress, *, enabled: bool) -> UnitImage:
    """The dump made smaller by its driver before packing (``COLDSNAP_ZERO_PAGES=keep``: as dumped)."""
    if not enabled:
        rb.details["zero_pages"] = {"skipped": "COLDSNAP_ZERO_PAGES=keep"}
        return image
    progress.step("leaving zero pages out of %.1f MB of process images" % (image.image_bytes / 1e6))
    with rb.phase("compact"):
        done = driver.compact_images(images)
    if done is None:
        return image
    rb.details["zero_pages"] = done
    return image.model_copy(update={"image_bytes": sum(f.stat().st_size for f in images.rglob("*") if f.is_file())})


def _checkpoint_at_capture_point(run: CaptureRun) -> tuple[UnitImage, Validation, NativePayload | None]:
    """The capture story, for any driver.

    A serving driver captures the validated engine after it wrote its native weights and
    released its device memory. A template driver captures at its boundary before the engine
    serves, and lets it go on afterwards to serve once, for the reply restores must reproduce.
    """
    r, rb, progress = run.r, run.rb, run.progress
    validation: Validation | None = None
    native = None
    if r.driver.checkpoints_serving:
        validation = _ready_and_validated(run, run.t0)
        native = (reused_native(run) or _export_native(run)) if run.native_wanted else None
        if native is not None:
            pack_native(native, rb, progress)
        if r.driver.needs_release:
            with rb.phase("release_memory"):
                r.adapter.release_memory(run.endpoint)
    else:
        with rb.phase("boundary"), progress.waiting("waiting for the engine to reach the %s driver's boundary" % r.driver.name):
            r.driver.await_boundary(run.unit, run.log_path, run.req.ready_timeout_seconds)
    _precheck(run)
    with rb.phase("record_files"):
        # What the tree depends on, as it is now: a restore compares it first (a host
        # library upgraded since is refused before eviction, not inside criu restore).
        files = r.launcher.record_files(run.unit, skip=[str(run.log_path)])
    model_dir = run.req.workload.model.path
    foreign = pinning.foreign_model_files([f.path for f in files], model_dir) if model_dir else []
    if foreign:
        raise CaptureError(
            "the engine loaded %s, which is not a file of the pinned snapshot %s: the capsule would not hold the weights it records; pass the pinned revision to the engine"
            % (foreign[0] if len(foreign) == 1 else "%s (and %d more)" % (foreign[0], len(foreign) - 1), model_dir)
        )
    with rb.phase("checkpoint"), progress.waiting("checkpointing the process tree") as tick:
        image = r.launcher.checkpoint(r.driver, run.unit, run.images, unit_def=run.unit_def, progress=lambda m: tick(0, m))
    image = image.model_copy(update={"files": files})
    rb.details["recorded_files"] = len(files)
    t_resume = time.monotonic()
    r.driver.after_checkpoint(run.unit.root_pid)
    if validation is None:
        validation = _ready_and_validated(run, t_resume)
    return image, validation, native


def _ready_and_validated(run: CaptureRun, t0: float) -> Validation:
    r, rb, req = run.r, run.rb, run.req
    wait_ready(r, run.endpoint, run.unit, rb, run.progress, req.ready_timeout_seconds)
    with rb.phase("validate"):
        validation = validate(r, run.endpoint, req, t0, req.validation.expected_reply)
    rb.validation = validation
    if not validation.passed:
        raise ValidationError("the engine replied %r, the recipe expects %r: fix coldsnap.validation.expected_reply" % (validation.reply, validation.expected_reply))
    if run.live:
        run.progress.note("the serving engine replied %r" % validation.reply)
        return validation
    run.progress.note("first token %.1f s after launch; reply %r" % (validation.ttft_seconds or 0, validation.reply))
    rb.details["vanilla_ttft_seconds"] = validation.ttft_seconds
    return validation


def _precheck(run: CaptureRun) -> None:
    """What the driver cannot capture, and whether the disks have room for what it will write."""
    with run.rb.phase("precheck"):
        problems = run.r.driver.precheck(run.unit.root_pid)
        estimate = disk_room.dump_estimate(tree_pids(run.unit.root_pid))
        short = disk_room.shortfall(estimate, run.r.launcher.room_needed(run.images))
    run.rb.details["dump_estimate_bytes"] = estimate
    if problems:
        raise CaptureError("cannot capture the workload: %s" % "; ".join(problems))
    if short:
        raise CaptureError("%s; free space there, or put the capsule store on a larger disk (coldsnap.capsule.store)" % short)


def reused_native(run: CaptureRun) -> NativePayload | None:
    """The payload a live capture can keep instead of writing it again: the engine's weights have
    not changed since they were loaded from it (the same tensors, the same workers' layout); used
    only where it is on this host and intact."""
    record = run.native_reuse
    if record is None:
        return None
    problems = native_payload.problems(record)
    if problems:
        run.rb.details["native_not_reused"] = problems[0]
        return None
    run.rb.details["native_reused"] = record.digest
    return record


def pack_native(record: NativePayload, rb: ReceiptBuilder, progress: Progress) -> None:
    """Keep a packed copy of the payload beside it: a node reading it from the disk reads about
    two thirds of the bytes."""
    with rb.phase("native_pack"):
        rb.details["native_packed"] = packed_payload.keep_packed(native_payload.directory(record), record.files, progress)


def _export_native(run: CaptureRun) -> NativePayload | None:
    try:
        with run.rb.phase("native_export"), run.progress.waiting("writing the native weight payload"):
            record, reports = native_payload.export(run.r.adapter, run.endpoint)
    except ColdsnapError as err:
        if run.req.workload.weights == "native":
            raise CaptureError("writing the native weight payload failed: %s; capture with weights: auto or recovery" % err) from err
        run.rb.details["native_export_error"] = str(err)  # auto: restores take the recovery path
        run.progress.note("no native weight payload (%s): restores will use recovery" % err)
        return None
    run.rb.details["native_export"] = list(reports)
    return record
