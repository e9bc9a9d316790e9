"""Capture: the one story, for one unit on this host, a live workload (a hibernate) and
several units on their hosts.

Admission before anything starts (the driver where the units run, the pinned snapshot, what
the placement refuses); the model files' digests; the units started (or the live one taken as
it runs); for a serving driver, the engine ready and validated, its native weight payload
written and its device memory released, for a template driver its boundary reached; every
unit checkpointed (at one cut when there are several) and ended; the model files checked
again; the images made smaller and packed; the capsule config written and published last.

How each step reaches the units is a :class:`CaptureUnits`: ``capture_here.HereCapture``
(one unit, this host's launcher) or ``capture_hosts.HostsCapture`` (every unit on its host,
through the typed steps of ``units/``). A failure stops what the capture started (never a
live workload) and publishes nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sparkrun_coldsnap import secrets
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.pack import PackedLayer
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.admit import admit_snapshot
from sparkrun_coldsnap.controller.common import Attempt, finish
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, CapturedValidation, EngineCaches, EngineRecord, ModelFile, NativePayload, WeightsRecord
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import CaptureRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.weights import model_files, weight_paths


@dataclass
class CaptureOutcome:
    receipt: Receipt
    capsule: Capsule | None = None


@dataclass(frozen=True)
class LiveWorkload:
    """An engine already serving (sparkrun's, a hibernate), captured where it runs: no launch,
    and a failure never stops it (a failed checkpoint leaves it running, its device memory
    taken back); once the capsule holds it, what the checkpoint left of it is stopped."""

    unit: RunningUnit
    log_path: Path
    #: the payload of the capsule it came back from, kept if still intact
    native: NativePayload | None = None


@dataclass
class Capturing:
    """What one capture carries from step to step, for whichever units it captures."""

    req: CaptureRequest
    settings: Settings
    rb: ReceiptBuilder
    progress: Progress
    attempt: Attempt
    #: what each unit's engine, driver and launcher are (set by admission)
    r: Resolved = field(init=False)
    #: whether the engine writes its native weight payload (set by admission)
    native_wanted: bool = False
    #: names of the credentials the captured memory holds (the capsule records them, never their values)
    credentials: set[str] = field(default_factory=set)
    #: what the engine's caches held once it served, packed as a layer (a driver that carries them)
    engine_caches: EngineCaches | None = None

    def launched_with(self, launch: secrets.CaptureLaunch) -> None:
        """A unit is started as *launch* says: what it was not given and what it holds, for the receipt and the capsule."""
        self.hold_credentials(launch.held)
        record = self.rb.details.setdefault("credentials", {"withheld": [], "held": []})
        record["withheld"] = sorted(set(record["withheld"]) | set(launch.withheld))
        record["held"] = sorted(self.credentials)

    def hold_credentials(self, names: Iterable[str]) -> None:
        self.credentials.update(names)
        if self.credentials:
            self.rb.details.setdefault("credentials", {"withheld": [], "held": []})["held"] = sorted(self.credentials)


class CaptureUnits(Protocol):
    """How each step of the capture reaches the units it captures."""

    #: the receipt's operation: ``capture``, or ``hibernate`` for a live workload
    operation: str
    #: whether the units are already serving (a hibernate: nothing is launched)
    live: bool

    def resolve(self, c: Capturing) -> Resolved:
        """The workload's names resolved for where the units run (refused: a RequestError)."""
        ...

    def admit(self, c: Capturing) -> None:
        """What the placement refuses before anything starts: the driver on every host, the port, what the launches need."""
        ...

    def start(self, c: Capturing, staging: Path, stack: contextlib.ExitStack) -> float:
        """The units started (io_uring off while they run, in *stack*), or the live one taken; when the clock started."""
        ...

    def endpoint(self, c: Capturing) -> Endpoint:
        """Where the engine answers (rank 0's)."""
        ...

    def ready(self, c: Capturing, t0: float) -> Validation:
        """The engine ready and its reply validated (a mismatch raised), the first token timed from *t0*."""
        ...

    def write_native(self, c: Capturing) -> NativePayload | None:
        """The engine's native weight payload written (or kept), where its units run; None: restores take the recovery path."""
        ...

    def await_boundary(self, c: Capturing) -> None:
        """A template driver: the engine reached the driver's boundary, before it serves."""
        ...

    def checkpoint(self, c: Capturing, staging: Path) -> list[UnitImage]:
        """What the driver cannot capture refused, every unit's files recorded, every unit checkpointed (at one cut)."""
        ...

    def after_checkpoint(self, c: Capturing) -> None:
        """What the driver does once the images are written (a template engine goes on to serve once)."""
        ...

    def end(self, c: Capturing, images: list[UnitImage]) -> None:
        """What the checkpoint left of the units stopped: nothing of them is needed any more."""
        ...

    def failed(self, c: Capturing, err: ColdsnapError) -> None:
        """After a failure before the units ended (a live workload gets its device memory back)."""
        ...

    def pack(self, c: Capturing, staging: Path, images: list[UnitImage], native: NativePayload | None) -> tuple[list[PackedLayer], list[UnitImage]]:
        """Every unit's images made smaller and packed into layers in *staging*; the units' records as the capsule keeps them."""
        ...

    def fingerprint(self, c: Capturing, images: list[UnitImage]) -> Fingerprint:
        """The host a restore must match (rank 0's)."""
        ...


def capture(req: CaptureRequest, units: CaptureUnits, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET) -> CaptureOutcome:
    """Capture *units* (see the module docstring) into a capsule of *store*, published under the request's tag."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder(units.operation, request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    rb.secrets = req.workload.secret_values()
    w = req.workload
    with settings_mod.using(settings), Attempt(rb) as attempt:
        c = Capturing(req, settings, rb, progress, attempt)
        with rb.phase("admission"):
            c.r = units.resolve(c)
            model_dir = admit_snapshot(w, c.r.adapter, launches=not units.live)
            c.native_wanted = weight_paths.writes_native(w, c.r.driver, c.r.adapter)
            units.admit(c)
            store.init()
        with rb.phase("model_digests"):
            recorded_files = model_files.record(model_dir)
        with contextlib.ExitStack() as stack:
            staging = stack.enter_context(store.staging_dir("hibernate-" if units.live else "capture-"))
            t0 = units.start(c, staging, stack)
            try:
                validation, native, images = _checkpoint_at_capture_point(c, units, staging, t0)
            except ColdsnapError as err:
                units.failed(c, err)
                raise
            units.end(c, images)
            with rb.phase("model_check"):
                # The digests recorded before the launch must still describe the files the engines read.
                changed = model_files.verify(model_dir, recorded_files)
            if changed:
                raise CaptureError("the model files changed while the engine loaded them: %s; capture again" % "; ".join(changed))
            layers, images = units.pack(c, staging, images, native)
            config = capsule_config(req, c.r, units.fingerprint(c, images), validation, recorded_files, native, tuple(images), credentials=tuple(sorted(c.credentials)), engine_caches=c.engine_caches)
            with rb.phase("publish"):
                desc = capsule_mod.publish(store, layers, config)
            rb.details["image_bytes"] = sum(i.image_bytes for i in images)
            rb.details["capsule_bytes"] = sum(layer.size for layer in layers)
    rb.capsule = desc.digest
    return CaptureOutcome(finish(rb, None), capsule_mod.open_capsule(store, req.capsule.ref))


def _checkpoint_at_capture_point(c: Capturing, units: CaptureUnits, staging: Path, t0: float) -> tuple[Validation, NativePayload | None, list[UnitImage]]:
    """A serving driver captures the validated engine after it wrote its native weights and
    released its device memory. A template driver captures at its boundary before the engine
    serves, and lets it go on afterwards to serve once, for the reply restores must reproduce."""
    r, rb = c.r, c.rb
    validation: Validation | None = None
    native = None
    detached = False
    if r.driver.checkpoints_serving:
        validation = _validated(c, units, t0)
        native = units.write_native(c) if c.native_wanted else None
        if r.driver.needs_release:
            with rb.phase("release_memory"), c.progress.waiting("releasing the engine's device memory"):
                r.adapter.release_memory(units.endpoint(c))
            if r.driver.rebuilds_communicators(r.adapter, c.req.workload.topology):
                # COLDSNAP_COMMUNICATORS=rebuild (cuda/ranks.py): the workers destroy their
                # communicators now; the restore makes them again.
                with rb.phase("detach_communicators"), c.progress.waiting("destroying the workers' NCCL communicators"):
                    rb.details["communicators_detached"] = list(r.adapter.detach_communicators(units.endpoint(c)))
                detached = True
    else:
        with rb.phase("boundary"), c.progress.waiting("waiting for the engine to reach the %s driver's boundary" % r.driver.name):
            units.await_boundary(c)
    images = units.checkpoint(c, staging)
    if detached:
        # The restore makes them again, whatever its own settings say.
        images = [i.model_copy(update={"driver_data": i.driver_data.merged(DriverData(communicators_detached=True))}) for i in images]
    t_resume = time.monotonic()
    units.after_checkpoint(c)
    if validation is None:
        validation = _validated(c, units, t_resume)
    return validation, native, images


def _validated(c: Capturing, units: CaptureUnits, t0: float) -> Validation:
    validation = units.ready(c, t0)
    if units.live:
        c.progress.note("the serving engine replied %r" % validation.reply)
    else:
        c.progress.note("first token %.1f s after launch; reply %r" % (validation.ttft_seconds or 0, validation.reply))
        c.rb.details["vanilla_ttft_seconds"] = validation.ttft_seconds
    return validation


def capsule_config(
    req: CaptureRequest, r: Resolved, fingerprint: Fingerprint, validation: Validation, recorded_files: tuple[ModelFile, ...], native: NativePayload | None,
    units: tuple[UnitImage, ...], *, credentials: tuple[str, ...] = (), engine_caches: EngineCaches | None = None,
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
        validation=CapturedValidation(prompt=req.validation.prompt, max_tokens=req.validation.max_tokens, reply=validation.reply or "", request_ttft_seconds=validation.request_ttft_seconds, tokens=validation.tokens),
        weights=WeightsRecord(location="in-image" if r.driver.weights_in_image else "external", model_id=w.model.id, revision=w.model.revision, files=recorded_files, native=native),
        units=units,
        engine_caches=engine_caches,
        credentials=credentials,
    )
