"""The one implementation of each operation: a request document in, a receipt out.

sparkrun's strategy, the verbs and the request entry (``--request FILE``) all call these, and
so can any other placement manager (a Kubernetes Job, a systemd unit, a shell script): the
manager owns scheduling, credentials, transport and workload identity; this API owns capture,
compatibility, restore and receipts. docs/integrators.md describes the documents, the exit
codes and the per-unit flow.

Every operation returns its receipt (inside an outcome where there is more to hand back);
a failure raises a :class:`~sparkrun_coldsnap.errors.ColdsnapError` whose ``receipt`` is the
failed (or refused) one and whose ``exit_code`` is the documented code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap import controller
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller import PreparedRestore, ServingOutcome
from sparkrun_coldsnap.controller.common import Attempt, finish
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder
from sparkrun_coldsnap.documents.request import REQUEST_FORMAT, CaptureRequest, RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.documents.strict import one_line
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, NotFoundError, RequestError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.progress import QUIET, Progress

__all__ = ["Activated", "Plan", "activate", "capture", "load_request", "prepare", "recapture_request", "restore", "verify"]


# -- requests as documents ------------------------------------------------------------------


def load_request(text: str, *, source: str = "request") -> CaptureRequest | RestoreRequest:
    """Parse a request document strictly: its ``format``, its ``operation``, every field, and
    its ``request_sha256`` when it carries one. A bad document is one RequestError naming the field."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise RequestError("%s: not JSON (line %d column %d: %s): pass the document `--dry-run` printed" % (source, err.lineno, err.colno, err.msg)) from None
    if not isinstance(doc, dict):
        raise RequestError("%s: a request document is a JSON object, not %s" % (source, type(doc).__name__))
    if doc.get("format") != REQUEST_FORMAT:
        raise RequestError("%s: format %r is not a request format this plugin reads (it reads %d): produce it again with --dry-run" % (source, doc.get("format"), REQUEST_FORMAT))
    kinds: dict[str, type[CaptureRequest] | type[RestoreRequest]] = {"capture": CaptureRequest, "restore": RestoreRequest}
    model = kinds.get(str(doc.get("operation")))
    if model is None:
        raise RequestError("%s: operation %r: a request is a capture or a restore" % (source, doc.get("operation")))
    try:
        req = model.model_validate(doc)
    except PydanticValidationError as err:
        raise RequestError(one_line(err, prefix=source)) from err
    if req.request_sha256 is not None and req.request_sha256 != req.digest():
        raise RequestError("%s: request_sha256 %s does not match the document's content (%s): it was changed after it was made" % (source, req.request_sha256, req.digest()))
    return req


def _store(store: CapsuleStore | str | Path | None) -> CapsuleStore:
    if isinstance(store, CapsuleStore):
        return store
    return CapsuleStore(Path(store).expanduser() if store else paths.default_store())


# -- capture ---------------------------------------------------------------------------------


def capture(request: CaptureRequest, *, store: CapsuleStore | str | Path | None = None, settings: Settings | None = None, progress: Progress = QUIET) -> controller.CaptureOutcome:
    """Start the request's engine, validate it, capture it into a capsule of *store*."""
    return controller.capture(request, store=_store(store), settings=settings, progress=progress)


# -- restore: prepare, then activate ---------------------------------------------------------


@dataclass
class Plan:
    """What activation will do: restore what was prepared, or start the engine vanilla (and why)."""

    request: RestoreRequest
    store: CapsuleStore
    settings: Settings
    prepared: PreparedRestore | None = None
    vanilla_because: str | None = None
    #: the refused restore's receipt, when a refusal turned into a vanilla start.
    refused: Receipt | None = None

    def discard(self) -> None:
        """Drop what preparation made (an activation that will not happen)."""
        if self.prepared is not None:
            self.prepared.discard()
            self.prepared = None


def prepare(
    request: RestoreRequest, *, store: CapsuleStore | str | Path | None = None, settings: Settings | None = None, progress: Progress = QUIET,
    replacing: Iterable[int] = (),
) -> Plan:  # fmt: skip
    """Everything that can fail before the old workload is stopped: admission and staging.

    *replacing*: the PIDs of the workload the restore replaces (its manager stops it between
    preparation and activation); what they hold does not refuse the capsule.

    A missing capsule follows the request's ``on_missing``, a refused one its
    ``on_incompatible``: ``fail`` raises, ``vanilla`` plans a vanilla start.
    """
    controller.require_one_unit(request.workload, "restore")  # before a missing capsule plans a vanilla start
    s = _store(store)
    settings = settings or settings_mod.current()
    try:
        s.resolve(request.capsule.ref)
    except NotFoundError:
        if request.on_missing == "fail":
            raise NotFoundError("capsule %s is not in %s and the request says on_missing: fail: capture it first" % (request.capsule.ref, s.root)) from None
        return Plan(request, s, settings, vanilla_because="no capsule %s in %s yet" % (request.capsule.ref, s.root))
    try:
        return Plan(request, s, settings, prepared=controller.prepare_restore(request, store=s, settings=settings, progress=progress, replacing=frozenset(replacing)))
    except CompatibilityError as err:
        if request.on_incompatible != "vanilla":
            raise
        # The capsule cannot come back here, but the workload still can; nothing was evicted.
        return Plan(request, s, settings, vanilla_because=str(err), refused=err.receipt)


def recapture_request(request: RestoreRequest) -> CaptureRequest:
    """The capture that makes the capsule *request* restores."""
    return CaptureRequest(**request.model_dump(include={"workload", "validation", "capsule", "ready_timeout_seconds"}))


@dataclass
class Activated:
    """A serving workload and every receipt its activation wrote, in order."""

    outcome: ServingOutcome
    receipts: list[Receipt]
    how: str  # "restored", "recaptured" or "vanilla"


def activate(
    plan: Plan, *, log_path: Path | None = None, on_started: Callable[[int], None] | None = None, progress: Progress = QUIET,
    on_note: Callable[[str], None] | None = None,
) -> Activated:  # fmt: skip
    """Bring the workload up as *plan* says; with ``recapture`` a vanilla start becomes a capture
    followed by a restore from the new capsule (a plain vanilla start if that capture fails)."""
    req = plan.request
    log_path = log_path or paths.run_dir() / "logs" / ("%s.log" % req.workload_name)
    note = on_note or (lambda text: None)
    if plan.prepared is not None:
        prepared, plan.prepared = plan.prepared, None
        return Activated(controller.activate_restore(prepared, log_path=log_path, progress=progress), [], "restored")
    receipts: list[Receipt] = []
    if req.recapture:
        note("%s: capturing the engine again (recapture: true), then restoring from the new capsule" % plan.vanilla_because)
        try:
            captured = controller.capture(recapture_request(req), store=plan.store, settings=plan.settings, progress=progress)
        except ColdsnapError as err:  # the workload must still come up: vanilla below
            if err.receipt is not None:
                receipts.append(err.receipt)
            note("recapture failed (%s): starting the engine vanilla instead" % err)
        else:
            receipts.append(captured.receipt)
            prepared = controller.prepare_restore(req, store=plan.store, settings=plan.settings, progress=progress)
            out = controller.activate_restore(prepared, log_path=log_path, progress=progress)
            return Activated(out, receipts, "recaptured")
    note("%s: starting the engine vanilla (capture it with `sparkrun coldsnap capture`)" % plan.vanilla_because)
    out = controller.start_vanilla(req, log_path=log_path, settings=plan.settings, progress=progress, on_started=on_started, because=plan.vanilla_because)
    return Activated(out, receipts, "vanilla")


def restore(
    request: RestoreRequest, *, store: CapsuleStore | str | Path | None = None, settings: Settings | None = None, log_path: Path | None = None,
    progress: Progress = QUIET, on_note: Callable[[str], None] | None = None,
) -> Activated:  # fmt: skip
    """Prepare, then activate: for a manager with nothing to evict in between."""
    return activate(prepare(request, store=store, settings=settings, progress=progress), log_path=log_path, progress=progress, on_note=on_note)


# -- verify ------------------------------------------------------------------------------------


def verify(ref: str, *, store: CapsuleStore | str | Path | None = None, progress: Progress = QUIET) -> Receipt:
    """Re-hash every blob of capsule *ref*; the receipt says how many bytes were checked."""
    s = _store(store)
    rb = ReceiptBuilder("verify")
    rb.capsule_ref = ref
    with Attempt(rb):
        with rb.phase("open"):
            cap = capsule_mod.open_capsule(s, ref)
        rb.capsule = cap.digest
        with rb.phase("verify"), progress.transfer("verifying %s" % ref, sum(d.size for d in cap.layers)):
            checked = capsule_mod.verify(s, cap)
    rb.details.update(verified_bytes=checked, blobs=len(cap.layers) + 2)
    return finish(rb, None)
