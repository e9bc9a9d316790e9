"""Restore: the one story, for one unit on this host and for several units on their hosts, in
two steps.

Prepare: everything that can fail while the old workload still serves. The capsule opened
(verified) from a trusted store; the workload resolved for where its units run; the capsule's
driver the recipe's; every unit admitted where it runs (its host's fingerprint, GPUs, PIDs,
files, its part of the weights) and the weight path chosen; every unit's images staged where
it runs.

Activate: the workload being replaced out of the way; every unit restored (at once, at the
captured cut, when there are several); the weights brought back; the engine ready; the reply
checked against the one recorded at capture, token by token where the capsule recorded its tokens
(``oracle.py``). Any failure stops what the restore brought back;
what preparation staged is dropped either way.

How each step reaches the units is a :class:`RestoreUnits`: ``restore_here.HereRestore`` (one
unit, this host's launcher) or ``restore_hosts.HostsRestore`` (every unit on its host, through
the typed steps of ``units/``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import signatures
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller import oracle
from sparkrun_coldsnap.controller.common import Attempt, ServingOutcome, finish, validate
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Weights
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CompatibilityError
from sparkrun_coldsnap.host import major_faults
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.weights.weight_paths import WeightChoice


@dataclass
class Preparing:
    """What one preparation carries from step to step."""

    req: RestoreRequest
    store: CapsuleStore
    settings: Settings
    rb: ReceiptBuilder
    progress: Progress
    attempt: Attempt
    capsule: Capsule
    #: set once resolved
    r: Resolved = field(init=False)


class RestoreUnits(Protocol):
    """How each step of the restore reaches the units it restores."""

    #: what a failure's message adds once every unit it brought back is stopped ("" for one unit here)
    told: str
    #: the receipt's wording for the engine that answers (``restored workload``, ``restored rank 0``) and where it runs
    replied: str
    where: str

    def resolve(self, p: Preparing) -> Resolved:
        """The workload's names resolved for where the units run; a placement the capsule cannot fit refused."""
        ...

    def admit(self, p: Preparing) -> tuple[WeightChoice | None, tuple[str, ...]]:
        """Every unit admitted where it runs (refused: a CompatibilityError); the weight path, and
        what the workload being replaced holds that the restore needs."""
        ...

    def stage(self, p: Preparing, weights: WeightChoice | None) -> WeightChoice | None:
        """Every unit's images staged where it runs (and, here, its weights made ready), dropped
        again on a failure; the weight path as it now stands."""
        ...

    def discard(self) -> None:
        """Drop what staging made, wherever it is."""
        ...

    def evict(self, prepared: PreparedRestore, attempt: Attempt) -> None:
        """The workload being replaced out of the way (stopped, or found gone); from here a failure stops what the restore brings back."""
        ...

    def restore(self, prepared: PreparedRestore, attempt: Attempt, *, log_path: Path | None, progress: Progress) -> RunningUnit:
        """Every unit brought back where it runs; what the restore hands back (rank 0's)."""
        ...

    def endpoint(self, prepared: PreparedRestore) -> Endpoint: ...

    def weights_back(self, prepared: PreparedRestore, running: RunningUnit, endpoint: Endpoint, progress: Progress) -> None:
        """The weights back in the engine (or the engine past its boundary loading them), ready to answer."""
        ...

    def after_validation(self, prepared: PreparedRestore, endpoint: Endpoint) -> None:
        """Off the clock, once the engine answered as recorded."""
        ...

    def record(self, prepared: PreparedRestore, running: RunningUnit) -> None:
        """What the restore measured of each unit, into the receipt."""
        ...


@dataclass
class PreparedRestore:
    """A capsule admitted and staged, ready to activate (the old workload still runs)."""

    request: RestoreRequest
    capsule: Capsule
    resolved: Resolved
    settings: Settings
    receipt: ReceiptBuilder
    units: RestoreUnits
    prepare_seconds: float = 0.0
    weights: WeightChoice | None = None
    #: what the restore needs that the workload it replaces holds (freed when that one is stopped)
    held_by_replaced: tuple[str, ...] = ()
    #: the tree was restored ahead (a warm workload): it holds the port, activation hydrates it
    restored_ahead: bool = False

    def discard(self) -> None:
        """Drop everything preparation made (an activation that never happens, or after one)."""
        self.units.discard()
        if self.weights is not None:
            self.weights.release_memory()


def open_trusted(req: RestoreRequest, store: CapsuleStore, rb: ReceiptBuilder) -> Capsule:
    """Capsule ``req.capsule`` opened and verified from a store this host trusts."""
    with rb.phase("prepare.open"):
        store.check_trusted()
        cap = capsule_mod.open_capsule(store, req.capsule.ref)
        rb.capsule = cap.digest
        if req.trust is not None:
            # Before admission and staging, so before the replaced workload is touched.
            why = signatures.refusal_in_store(store, req.capsule.ref, cap.digest, req.trust)
            if why:
                raise CompatibilityError("admission refused: %s" % why, code="admission.untrusted")
    return cap


def refuse_driver(cap: Capsule, req: RestoreRequest, r: Resolved) -> None:
    if cap.config.driver != r.driver.name:
        raise CompatibilityError("capsule %s was captured with driver %s, the recipe asks for %s" % (req.capsule.ref, cap.config.driver, r.driver.name))


def prepare(req: RestoreRequest, units: RestoreUnits, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET) -> PreparedRestore:
    """Admission and staging of *units*: everything that can fail before the old workload is stopped."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("restore", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    rb.secrets = req.workload.secret_values()
    t = time.monotonic()
    with settings_mod.using(settings), Attempt(rb) as attempt:
        p = Preparing(req, store, settings, rb, progress, attempt, open_trusted(req, store, rb))
        with rb.phase("prepare.admission"):
            p.r = units.resolve(p)
            refuse_driver(p.capsule, req, p.r)
            weights, held = units.admit(p)
        weights = units.stage(p, weights)
    return PreparedRestore(req, p.capsule, p.r, settings, rb, units, prepare_seconds=time.monotonic() - t, weights=weights, held_by_replaced=held)


def activate(prepared: PreparedRestore, *, log_path: Path | None = None, progress: Progress = QUIET) -> ServingOutcome:
    """Restore what *prepared* staged, bring its weights back, validate: a running, validated workload."""
    rb, req, cap, r, units = prepared.receipt, prepared.request, prepared.capsule, prepared.resolved, prepared.units
    try:
        with settings_mod.using(prepared.settings):
            with Attempt(rb) as attempt:
                units.evict(prepared, attempt)
                t0, faults = time.monotonic(), major_faults.of_self()
                with rb.phase("restore"):
                    running = units.restore(prepared, attempt, log_path=log_path, progress=progress)
                endpoint = units.endpoint(prepared)
                if prepared.weights is None and not r.driver.engine_loads_weights:
                    rb.weights = Weights(path="in-image")
                if any(u.driver_data.communicators_detached for u in cap.config.units):
                    # The workers destroyed their NCCL communicators before the checkpoint: made
                    # again over the CPU groups that came back with them, before the weights wake.
                    with rb.phase("attach_communicators"), progress.waiting("making the workers' NCCL communicators again"):
                        rb.details["communicators_attached"] = list(r.adapter.attach_communicators(endpoint))
                units.weights_back(prepared, running, endpoint, progress)
                expected = req.validation.expected_reply or cap.config.validation.reply
                with rb.phase("validate"):
                    validation = oracle.judge(validate(r, endpoint, req, t0, expected), cap.config.validation, req.validation)
                rb.validation = validation
                rb.details["activation_major_faults"] = major_faults.of_self() - faults  # this process's waits on the disk, on the clock
                if not validation.passed:
                    raise oracle.refusal(validation, replied=units.replied, ref=str(req.capsule.ref), where=units.where)
                units.after_validation(prepared, endpoint)
            rb.details["prepare_seconds"] = round(prepared.prepare_seconds, 4)
            units.record(prepared, running)
            return ServingOutcome(finish(rb, None), running.root_pid, validation.ttft_seconds, running)
    finally:
        prepared.discard()
