"""The capture's steps for one unit on this host (``capture.CaptureUnits``): launched through
the workload's launcher (a host process or a container), or a live workload already serving
here (a hibernate), checkpointed by the launcher with the driver."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from sparkrun_coldsnap import secrets
from sparkrun_coldsnap.capsule import engine_caches
from sparkrun_coldsnap.capsule.pack import PackedLayer, pack_unit
from sparkrun_coldsnap.compat import pinning
from sparkrun_coldsnap.controller.admit import admit_driver_here
from sparkrun_coldsnap.controller.capture import Capturing, LiveWorkload
from sparkrun_coldsnap.controller.common import require_one_unit, validate, wait_ready
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, RequestError, ValidationError
from sparkrun_coldsnap.host import disk_room, engine_temp, leftovers, paths
from sparkrun_coldsnap.host.iouring import io_uring_disabled
from sparkrun_coldsnap.host.ports import port_holder
from sparkrun_coldsnap.host.process_tree import environ_and_argv, tree_pids
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.units.resolved import Resolved, resolve
from sparkrun_coldsnap.weights import native_payload, packed_payload


class HereCapture:
    """One launch unit on this host: started for the capture, or *live* (already serving)."""

    def __init__(self, live: LiveWorkload | None = None) -> None:
        self.live_workload = live
        self.live = live is not None
        self.operation = "hibernate" if live is not None else "capture"
        self.unit: RunningUnit | None = live.unit if live is not None else None
        self.log_path: Path | None = live.log_path if live is not None else None
        #: where the engine's caches were pointed (a driver that carries them)
        self.caches: engine_caches.Pointed | None = None

    @property
    def running(self) -> RunningUnit:
        assert self.unit is not None, "the unit is started before it is used"
        return self.unit

    def resolve(self, c: Capturing) -> Resolved:
        w = c.req.workload
        require_one_unit(w, "capture")
        if self.live_workload is not None:
            c.rb.details["root_pid"] = self.live_workload.unit.root_pid
        else:
            # What a capture killed outright left (its engine on the port, io_uring off) is undone first.
            recovered = leftovers.recover()
            if recovered.stopped:
                c.rb.details["recovered"] = list(recovered.stopped)
        return resolve(w, c.settings)

    def admit(self, c: Capturing) -> None:
        w, r = c.req.workload, c.r
        admit_driver_here(r)
        if not self.live:
            holder = port_holder(w.launch.port)
            if holder:
                raise CaptureError("port %d is in use by %s: stop that workload (sparkrun stop) or capture on another port" % (w.launch.port, holder))
        r.launcher.check_capturable()
        if c.native_wanted and not self.live:
            # The engine writes its weights as loaded after minutes of start-up: refuse now when
            # they cannot fit where they go (the dump's own room is checked before the dump).
            short = native_payload.room_problem(Path(w.model.path) if w.model.path else None)
            if short:
                raise CaptureError("%s; free space there, or capture with coldsnap.weights: recovery (no payload written)" % short)
        if self.live and w.launch.executor != "local":
            raise RequestError("hibernate runs on host-process workloads (executor local); this one runs with executor %s" % w.launch.executor)

    def start(self, c: Capturing, staging: Path, stack: contextlib.ExitStack) -> float:
        """The engine started with what its driver needs of the launch, io_uring off while it
        runs; the unit is the attempt's to stop on a failure, and a leftover until it ends."""
        if self.live:
            # Already running: whatever credentials it was given are in its memory; the capsule says which.
            held: set[str] = set()
            for pid in tree_pids(self.running.root_pid):
                held.update(secrets.held_by(*environ_and_argv(pid)))
            c.hold_credentials(held)
            return time.monotonic()
        req, r, rb, w = c.req, c.r, c.rb, c.req.workload
        launch = secrets.for_capture(w.launch.command, r.launcher.engine_env(w, r.engine_env, c.settings.environ), given=w.launch.env, serving=r.adapter.serving_credentials)
        c.launched_with(launch)
        command, env = r.adapter.prepare_launch(launch.command, launch.env, release_weights=r.driver.needs_release, native_weights=c.native_wanted)
        launched = command, dict(env)
        command, env = r.driver.launch_settings(command, env, adapter=r.adapter, topology=w.topology)
        if (command, env) != launched:  # what the driver needs of the launch, for whoever reads the receipt
            rb.details["driver_launch"] = {"flags": command[len(launched[0]) :].split(), "env": {k: v for k, v in env.items() if launched[1].get(k) != v}}
        if r.driver.carries_engine_caches:
            # Set before the engine starts, so the captured memory holds these paths.
            env, self.caches = engine_caches.point(env, r.adapter.compile_caches, engine_caches.directory(req.digest()))
            rb.details["engine_caches"] = {"directory": str(self.caches.directory), "carried": sorted(self.caches.carried), "kept": list(self.caches.kept)}
        command = r.driver.launch_command(command, r.adapter, c.settings)
        self.log_path = paths.run_dir() / "logs" / ("capture-%s-%d.log" % (req.capsule.name, os.getpid()))
        self.log_path.unlink(missing_ok=True)
        stack.enter_context(io_uring_disabled())
        c.progress.step("starting %s for capture (%s, driver %s)" % (w.engine, req.capsule.ref, r.driver.name))
        with rb.phase("launch"):
            t0 = time.monotonic()
            self.unit = c.attempt.running = r.launcher.start(w, command, env, log_path=self.log_path, name="coldsnap-capture-%s" % req.capsule.name)
        leftovers.adopt(self.unit.root_pid, "the engine of a capture of %s" % req.capsule.ref)
        stack.callback(leftovers.release, self.unit.root_pid)
        return t0

    def endpoint(self, c: Capturing) -> Endpoint:
        w = c.req.workload
        return c.r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)

    def ready(self, c: Capturing, t0: float) -> Validation:
        r, rb, req = c.r, c.rb, c.req
        endpoint = self.endpoint(c)
        wait_ready(r, endpoint, self.running, rb, c.progress, req.ready_timeout_seconds)
        with rb.phase("validate"):
            validation = validate(r, endpoint, req, t0, req.validation.expected_reply)
        rb.validation = validation
        if not validation.passed:
            raise ValidationError("the engine replied %r, the recipe expects %r: fix coldsnap.validation.expected_reply" % (validation.reply, validation.expected_reply))
        return validation

    def write_native(self, c: Capturing) -> NativePayload | None:
        native = reused_native(self.live_workload.native if self.live_workload else None, c.rb) or self._export_native(c)
        if native is not None:
            pack_native(native, c.rb, c.progress)
        return native

    def _export_native(self, c: Capturing) -> NativePayload | None:
        try:
            with c.rb.phase("native_export"), c.progress.waiting("writing the native weight payload"):
                record, reports = native_payload.export(c.r.adapter, self.endpoint(c))
        except ColdsnapError as err:
            if c.req.workload.weights == "native":
                raise CaptureError("writing the native weight payload failed: %s; capture with weights: auto or recovery" % err) from err
            c.rb.details["native_export_error"] = str(err)  # auto: restores take the recovery path
            c.progress.note("no native weight payload (%s): restores will use recovery" % err)
            return None
        c.rb.details["native_export"] = list(reports)
        return record

    def await_boundary(self, c: Capturing) -> None:
        assert self.log_path is not None
        c.r.driver.await_boundary(self.running, self.log_path, c.req.ready_timeout_seconds)

    def checkpoint(self, c: Capturing, staging: Path) -> list[UnitImage]:
        r, rb = c.r, c.rb
        unit_def = c.req.workload.topology.units[0]
        images = staging / "units" / unit_def.name
        self._precheck(c, images)
        with rb.phase("record_files"):
            # What the tree depends on, as it is now: a restore compares it first (a host
            # library upgraded since is refused before eviction, not inside criu restore).
            files = r.launcher.record_files(self.running, skip=[str(self.log_path)])
        model_dir = c.req.workload.model.path
        foreign = pinning.foreign_model_files([f.path for f in files], model_dir) if model_dir else []
        if foreign:
            raise CaptureError(
                "the engine loaded %s, which is not a file of the pinned snapshot %s: the capsule would not hold the weights it records; pass the pinned revision to the engine"
                % (foreign[0] if len(foreign) == 1 else "%s (and %d more)" % (foreign[0], len(foreign) - 1), model_dir)
            )
        with rb.phase("checkpoint"), c.progress.waiting("checkpointing the process tree") as tick:
            image = r.launcher.checkpoint(r.driver, self.running, images, unit_def=unit_def, progress=lambda m: tick(0, m))
        rb.details["recorded_files"] = len(files)
        return [image.model_copy(update={"files": files})]

    def _precheck(self, c: Capturing, images: Path) -> None:
        """What the driver cannot capture, and whether the disks have room for what it will write."""
        with c.rb.phase("precheck"):
            problems = c.r.driver.precheck(self.running.root_pid)
            pids = tree_pids(self.running.root_pid)
            estimate = disk_room.dump_estimate(pids)
            estimate += c.r.driver.device_memory(pids)
            short = disk_room.shortfall(estimate, c.r.launcher.room_needed(images))
        c.rb.details["dump_estimate_bytes"] = estimate
        if problems:
            raise CaptureError("cannot capture the workload: %s" % "; ".join(problems))
        if short:
            raise CaptureError("%s; free space there, or put the capsule store on a larger disk (coldsnap.capsule.store)" % short)

    def after_checkpoint(self, c: Capturing) -> None:
        c.r.driver.after_checkpoint(self.running.root_pid)

    def end(self, c: Capturing, images: list[UnitImage]) -> None:
        # Past the checkpoint: a serving tree is gone (a container stopped), a template
        # served once for the reply; either way nothing of it is needed any more.
        c.attempt.running = None
        if self.live:
            with c.rb.phase("stop"):
                self.running.stop(grace=10.0)  # what the checkpoint left of the tree (CRIU ended it already)
        else:
            self.running.stop(grace=10.0)
            self.running.reap()
        engine_temp.sweep(keep=frozenset(f.path for i in images for f in i.files))  # the stopped engine's sockets and init files in /tmp

    def failed(self, c: Capturing, err: ColdsnapError) -> None:
        """After a failed checkpoint, a live tree that still runs gets back the device memory it released for it."""
        if not self.live or self.unit is None:
            return
        released = "release_memory" in {p.name for p in c.rb.phases}
        if not released or not self.unit.alive():
            c.rb.details["workload_state"] = "running" if self.unit.alive() else "gone"
            return
        try:
            if "detach_communicators" in {p.name for p in c.rb.phases}:  # one that failed half-way too
                with c.rb.phase("attach_after_failure"):
                    c.r.adapter.attach_communicators(self.endpoint(c))
            with c.rb.phase("wake_after_failure"):
                c.r.adapter.wake(self.endpoint(c), 2, model_dir=c.req.workload.model.path or "")
            c.rb.details["workload_state"] = "running"
        except ColdsnapError as wake_err:
            c.rb.details["workload_state"] = "running, its memory released"
            err.args = ("%s; waking it again also failed: %s" % (err.message, wake_err),)

    def pack(self, c: Capturing, staging: Path, images: list[UnitImage], native: NativePayload | None) -> tuple[list[PackedLayer], list[UnitImage]]:
        unit_def = c.req.workload.topology.units[0]
        where = staging / "units" / unit_def.name
        image = _without_zero_pages(c, where, images[0])
        with c.rb.phase("pack"), c.progress.transfer("packing %.1f MB of process images" % (image.image_bytes / 1e6), image.image_bytes) as tick:
            layers = pack_unit(where, unit_def.name, staging, tick=tick)
        if self.caches is not None:
            layers.extend(self._pack_caches(c, staging))
        return layers, [image]

    def _pack_caches(self, c: Capturing, staging: Path) -> list[PackedLayer]:
        """What the engine compiled after the boundary, as it served (it has stopped), one layer."""
        assert self.caches is not None
        with c.rb.phase("pack_engine_caches"):
            packed = engine_caches.pack(self.caches, staging)
        if packed is None:
            c.rb.details["engine_caches"]["files"] = 0
            return []
        layer, c.engine_caches = packed
        c.rb.details["engine_caches"].update(files=c.engine_caches.files, bytes=c.engine_caches.bytes, layer=layer.digest)
        c.progress.note("carrying %d files (%.1f MB) of the engine's caches" % (c.engine_caches.files, c.engine_caches.bytes / 1e6))
        return [layer]

    def fingerprint(self, c: Capturing, images: list[UnitImage]) -> Fingerprint:
        return c.r.fingerprint(c.req.workload, images[0].criu_version)


def _without_zero_pages(c: Capturing, images: Path, image: UnitImage) -> UnitImage:
    """The dump made smaller by its driver before packing (``COLDSNAP_ZERO_PAGES=keep``: as dumped)."""
    if not c.settings.zero_pages:
        c.rb.details["zero_pages"] = {"skipped": "COLDSNAP_ZERO_PAGES=keep"}
        return image
    c.progress.step("leaving zero pages out of %.1f MB of process images" % (image.image_bytes / 1e6))
    with c.rb.phase("compact"):
        done = c.r.driver.compact_images(images)
    if done is None:
        return image
    c.rb.details["zero_pages"] = done
    return image.model_copy(update={"image_bytes": sum(f.stat().st_size for f in images.rglob("*") if f.is_file())})


def reused_native(record: NativePayload | None, rb: ReceiptBuilder) -> NativePayload | None:
    """The payload a live capture can keep instead of writing it again: the engine's weights have
    not changed since they were loaded from it (the same tensors, the same workers' layout); used
    only where it is on this host and intact."""
    if record is None:
        return None
    problems = native_payload.problems(record)
    if problems:
        rb.details["native_not_reused"] = problems[0]
        return None
    rb.details["native_reused"] = record.digest
    return record


def pack_native(record: NativePayload, rb: ReceiptBuilder, progress: Progress) -> None:
    """Keep a packed copy of the payload beside it: a node reading it from the disk reads about
    two thirds of the bytes."""
    with rb.phase("native_pack"):
        rb.details["native_packed"] = packed_payload.keep_packed(native_payload.directory(record), record.files, progress)
