"""The one door into the controller: each operation, a request document in, a receipt out.

sparkrun's strategy, the verbs, the lifecycle, the benchmarks and the request entry
(``--request FILE``) all call these, and so can any other placement manager (a Kubernetes Job,
a systemd unit, a shell script): the manager owns scheduling, credentials, transport and
workload identity; this API owns capture, compatibility, restore and receipts. Outside
``controller/`` only this module imports the controller (``tests/test_layers.py`` checks), so
a change to how the controller tells its stories is answered here once. docs/integrators.md describes the
documents, the exit codes and the per-unit flow.

A workload of one unit runs on this host; one of several runs over the hosts it was placed on
(:class:`~sparkrun_coldsnap.launch.remote.UnitHosts`): the ``*_units`` operations.

Every operation returns its receipt (inside an outcome where there is more to hand back);
a failure raises a :class:`~sparkrun_coldsnap.errors.ColdsnapError` whose ``receipt`` is the
failed (or refused) one and whose ``exit_code`` is the documented code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap import controller
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller import (
    Attempt,
    CaptureOutcome,
    HereCapture,
    HereRestore,
    HostsCapture,
    HostsRestore,
    LiveWorkload,
    PreparedRestore,
    ServingOutcome,
    UnitOnHost,
    finish,
    open_and_admit,
    ordered,
    unpack_capsule,
    unpacked_size,
)  # fmt: skip
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import REQUEST_FORMAT, CaptureRequest, RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.documents.strict import one_line
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, NotFoundError, RequestError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.weights.weight_paths import WeightChoice

__all__ = [
    "LiveWorkload",
    # operations
    "activate", "activate_restore", "activate_units", "admission", "capture", "capture_units", "load_request", "prepare", "prepare_restore",
    "prepare_units", "recapture_request", "refuse_topology", "restore", "start_units", "start_vanilla", "verify", "when_missing",
    # what they take and hand back
    "Activated", "CaptureOutcome", "Plan", "PreparedRestore", "Resolved", "ServingOutcome", "StartedUnits", "UnitOnHost",
    # where the units of a restore are: this host's one, or a tree restored ahead (``lifecycle/warm.py``)
    "HereRestore",
    # a receipt's failure handling, for the operations the lifecycle tells itself (sleep, wake, warm)
    "Attempt", "finish",
    # the steps of a restore prepared ahead (``lifecycle/warm.py``)
    "open_and_admit", "ordered", "unpack_capsule", "unpacked_size",
]  # fmt: skip


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


def capture(
    request: CaptureRequest, *, store: CapsuleStore | str | Path | None = None, settings: Settings | None = None, progress: Progress = QUIET,
    live: LiveWorkload | None = None,
) -> CaptureOutcome:  # fmt: skip
    """Start the request's engine, validate it, capture it into a capsule of *store*; with *live*,
    capture that serving workload instead of starting one (a hibernate: a failure leaves it serving)."""
    return controller.capture(request, HereCapture(live), store=_store(store), settings=settings, progress=progress)


def capture_units(
    request: CaptureRequest, hosts: UnitHosts, *, store: CapsuleStore, init_port: int, settings: Settings | None = None, progress: Progress = QUIET,
) -> CaptureOutcome:  # fmt: skip
    """Start every unit of *request* on its host, validate through rank 0, checkpoint all at one cut, publish."""
    return controller.capture(request, HostsCapture(hosts, init_port=init_port), store=store, settings=settings, progress=progress)


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
        return when_missing(request, s, settings)
    try:
        return Plan(request, s, settings, prepared=prepare_restore(request, store=s, settings=settings, progress=progress, replacing=frozenset(replacing)))
    except CompatibilityError as err:
        if request.on_incompatible != "vanilla":
            raise
        # The capsule cannot come back here, but the workload still can; nothing was evicted.
        return Plan(request, s, settings, vanilla_because=str(err), refused=err.receipt)


def when_missing(
    request: RestoreRequest, store: CapsuleStore, settings: Settings, *, asked_by: str = "the request says", fix: str = "capture it first",
    repository: str | None = None, pull_error: NotFoundError | None = None,
) -> Plan:  # fmt: skip
    """What a restore does when capsule ``request.capsule`` is not in *store* (nor, when a pull
    from *repository* was tried, there: *pull_error* says why): ``on_missing: fail`` raises,
    ``vanilla`` plans a vanilla start that says why.

    *asked_by* names where ``on_missing`` was set and *fix* how to make the capsule, as the
    caller's user knows them (the request document, a recipe)."""
    ref = request.capsule.ref
    if request.on_missing == "fail":
        if pull_error is not None:
            raise pull_error  # the registry's own account of what it lacks
        raise NotFoundError("capsule %s is not in %s and %s on_missing: fail: %s" % (ref, store.root, asked_by, fix)) from None
    if repository and pull_error is not None:
        return Plan(request, store, settings, vanilla_because="no capsule %s here nor in %s (%s)" % (ref, repository, pull_error))
    return Plan(request, store, settings, vanilla_because="no capsule %s in %s yet" % (ref, store.root))


def prepare_restore(
    request: RestoreRequest, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET, replacing: frozenset[int] = frozenset(),
    staged_at: Path | None = None,
) -> PreparedRestore:  # fmt: skip
    """Admission and staging of capsule ``request.capsule``, with no policy: a missing or refused
    capsule raises (what a benchmark and a restore prepared ahead want). *staged_at*: images
    unpacked earlier (a warm restore), which admission checks again and nothing unpacks."""
    return controller.prepare(request, HereRestore(replacing=replacing, staged_at=staged_at), store=store, settings=settings, progress=progress)


def activate_restore(prepared: PreparedRestore, *, log_path: Path, progress: Progress = QUIET) -> ServingOutcome:
    """Restore what *prepared* staged, bring its weights back, validate: a running, validated workload."""
    return controller.activate(prepared, log_path=log_path, progress=progress)


def start_vanilla(
    request: RestoreRequest, *, log_path: Path, settings: Settings | None = None, progress: Progress = QUIET, on_started: Callable[[int], None] | None = None,
    because: str | None = None,
) -> ServingOutcome:  # fmt: skip
    """Start the engine the ordinary way (no capsule, or one refused: *because* says why), wait, validate."""
    return controller.start_vanilla(request, log_path=log_path, settings=settings, progress=progress, on_started=on_started, because=because)


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
        return Activated(activate_restore(prepared, log_path=log_path, progress=progress), [], "restored")
    receipts: list[Receipt] = []
    if req.recapture:
        note("%s: capturing the engine again (recapture: true), then restoring from the new capsule" % plan.vanilla_because)
        try:
            captured = capture(recapture_request(req), store=plan.store, settings=plan.settings, progress=progress)
        except ColdsnapError as err:  # the workload must still come up: vanilla below
            if err.receipt is not None:
                receipts.append(err.receipt)
            note("recapture failed (%s): starting the engine vanilla instead" % err)
        else:
            receipts.append(captured.receipt)
            prepared = prepare_restore(req, store=plan.store, settings=plan.settings, progress=progress)
            out = activate_restore(prepared, log_path=log_path, progress=progress)
            return Activated(out, receipts, "recaptured")
    note("%s: starting the engine vanilla (capture it with `sparkrun coldsnap capture`)" % plan.vanilla_because)
    unpinned = controller.unpinned_vanilla(req.workload)
    if unpinned:  # the one capture refuses: a vanilla start would otherwise serve whatever refs/main names unsaid
        note(unpinned)
    out = start_vanilla(req, log_path=log_path, settings=plan.settings, progress=progress, on_started=on_started, because=plan.vanilla_because)
    return Activated(out, receipts, "vanilla")


def restore(
    request: RestoreRequest, *, store: CapsuleStore | str | Path | None = None, settings: Settings | None = None, log_path: Path | None = None,
    progress: Progress = QUIET, on_note: Callable[[str], None] | None = None,
) -> Activated:  # fmt: skip
    """Prepare, then activate: for a manager with nothing to evict in between."""
    return activate(prepare(request, store=store, settings=settings, progress=progress), log_path=log_path, progress=progress, on_note=on_note)


# -- a restore's admission, asked without restoring ----------------------------------------------


def admission(capsule: Capsule, request: RestoreRequest, *, settings: Settings | None = None) -> tuple[list[str], WeightChoice | None]:
    """Admission of *capsule* for *request* on this host: what refuses it (nothing: admitted) and
    the path its weights would take."""
    return controller.check_admission(capsule, request, controller.resolve(request.workload, settings or settings_mod.current()))


def refuse_topology(capsule: Capsule, request: RestoreRequest) -> None:
    """A CompatibilityError when the run's placement is not the captured one (units, ranks, hosts)."""
    controller.refuse_topology(capsule, request)


# -- several units, over the hosts they were placed on ------------------------------------------


def prepare_units(request: RestoreRequest, hosts: UnitHosts, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET) -> PreparedRestore:
    """Topology, admission on every host, each unit's layers staged on its host (nothing stopped yet)."""
    return controller.prepare(request, HostsRestore(hosts), store=store, settings=settings, progress=progress)


def activate_units(prepared: PreparedRestore, *, progress: Progress = QUIET) -> ServingOutcome:
    """Restore every unit *prepared* staged at once, bring the weights back, validate through rank 0."""
    return controller.activate(prepared, progress=progress)


@dataclass(frozen=True)
class StartedUnits:
    """Every unit started the ordinary way and validated through rank 0."""

    receipt: Receipt
    validation: Validation


def start_units(
    request: RestoreRequest, hosts: UnitHosts, *, init_port: int, settings: Settings | None = None, progress: Progress = QUIET, because: str | None = None,
    details: Callable[[], Mapping[str, Any]] | None = None,
) -> StartedUnits:  # fmt: skip
    """Start every unit of *request* on its host (head first), wait for rank 0, validate through it;
    a failure stops every rank started. *because*: why not a restore; *details*: what the caller
    adds to the receipt once every unit serves."""
    rb = ReceiptBuilder("start", request_sha256=request.digest())
    if because:
        rb.details["instead_of_restore"] = because
    r = controller.resolve(request.workload, settings or settings_mod.current())
    with Attempt(rb, stop=hosts.stop_all, told="every rank started has been stopped"):
        validation = controller.start_units(r, request, hosts, rb, progress, init_port=init_port)
    if details is not None:
        rb.details.update(details())
    return StartedUnits(rb.finish("succeeded"), validation)


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
