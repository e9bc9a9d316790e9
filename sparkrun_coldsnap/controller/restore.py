"""Restore in two steps: prepare (admission, staging: all that can fail while the old workload
still serves), then activate (restore, bring the weights back, validate)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat.admission import admission
from sparkrun_coldsnap.controller.common import Attempt, ServingOutcome, finish, require_one_unit, validate
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Weights
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.engines.base import Endpoint, HydrationResult
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, RestoreError, ValidationError
from sparkrun_coldsnap.host import engine_temp, major_faults, paths
from sparkrun_coldsnap.host.atomic import owned_prefix
from sparkrun_coldsnap.host.background import Milestone, in_background
from sparkrun_coldsnap.host.ports import port_holder_settled
from sparkrun_coldsnap.launch.base import StagedUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved, resolve
from sparkrun_coldsnap.weights import page_cache, weight_paths, weights_memory


def new_restore_staging(store: CapsuleStore, unpacked_bytes: int) -> Path:
    """Memory-backed staging when there is room for it, else the store's own."""
    memory = paths.memory_staging(unpacked_bytes)
    if memory is not None:
        return paths.new_memory_staging(memory, owned_prefix("restore-"))
    return store.new_staging_dir("restore-")


@dataclass
class PreparedRestore:
    """A capsule admitted and staged, ready to activate (the old workload still runs)."""

    request: RestoreRequest
    capsule: Capsule
    resolved: Resolved
    settings: Settings
    receipt: ReceiptBuilder
    staged: StagedUnit
    prepare_seconds: float = 0.0
    weights: weight_paths.WeightChoice | None = None
    #: what the restore needs that the workload it replaces holds (freed when that one is stopped)
    held_by_replaced: tuple[str, ...] = ()
    #: the tree was restored ahead (a warm workload): it holds the port, activation hydrates it
    restored_ahead: bool = False

    def discard(self) -> None:
        """Drop everything preparation made (an activation that never happens, or after one)."""
        self.staged.discard()
        if self.weights is not None:
            self.weights.release_memory()


def check_admission(cap: Capsule, req: RestoreRequest, r: Resolved, *, replacing: frozenset[int] = frozenset()) -> tuple[list[str], weight_paths.WeightChoice | None]:
    """Admission of *cap* for *req* on this host, with this host's fingerprint."""
    here = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
    return admission(cap.config, req, here, r.driver, r.adapter, replacing=replacing)


def held_by_replaced(cap: Capsule, r: Resolved, problems: list[str], replacing: frozenset[int]) -> tuple[str, ...]:
    """What the driver would refuse if the workload being replaced (*replacing*) were not stopped first."""
    if not replacing:
        return ()
    return tuple(p for unit in cap.config.units for p in r.driver.admission(unit) if p not in problems)


def open_and_admit(
    req: RestoreRequest, store: CapsuleStore, settings: Settings, rb: ReceiptBuilder, *, replacing: frozenset[int] = frozenset(),
) -> tuple[Capsule, Resolved, weight_paths.WeightChoice | None, tuple[str, ...]]:  # fmt: skip
    """Open capsule ``req.capsule`` (verified) and admit it here; also what the replaced workload holds that it needs."""
    with rb.phase("prepare.open"):
        store.check_trusted()
        cap = capsule_mod.open_capsule(store, req.capsule.ref)
        rb.capsule = cap.digest
    with rb.phase("prepare.admission"):
        require_one_unit(req.workload, "restore")
        r = resolve(req.workload, settings)
        if cap.config.driver != r.driver.name:
            raise CompatibilityError("capsule %s was captured with driver %s, the recipe asks for %s" % (req.capsule.ref, cap.config.driver, r.driver.name))
        problems, choice = check_admission(cap, req, r, replacing=replacing)
        if problems:
            raise CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, "; ".join(problems)))
        held = held_by_replaced(cap, r, problems, replacing)
        if held:
            rb.details["held_by_replaced_workload"] = list(held)
        tools = r.driver.ready_tools()
        if tools is not None:
            rb.details["restore_tools"] = tools
    return cap, r, choice, held


def prepare_restore(
    req: RestoreRequest, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET, replacing: frozenset[int] = frozenset(),
    staged_at: Path | None = None,
) -> PreparedRestore:  # fmt: skip
    """Admission and staging: everything that can fail before the old workload is stopped.

    *replacing* is the PIDs of the workload this restore replaces: the captured PIDs and shared
    files they hold are freed when it is stopped, which happens after staging and before the
    restore; they are named in the result (``held_by_replaced``) and the receipt, not refused.

    *staged_at*: a staging directory where the capsule's layers were already unpacked and
    verified (a warm restore, :mod:`sparkrun_coldsnap.lifecycle.warm`); admission runs again,
    the unpacking does not."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("restore", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    rb.secrets = req.workload.secret_values()
    t = time.monotonic()
    with settings_mod.using(settings), Attempt(rb) as attempt:
        cap, r, choice, held = open_and_admit(req, store, settings, rb, replacing=replacing)
        background = settings.cache_in_background
        stages_payload = choice is not None and choice.path == "native" and choice.native_dir is not None and settings.weights_memory and r.adapter.maps_native
        files_read: Future[None] | None = None
        files_queued = Milestone()
        if stages_payload:
            # What the restore itself reads goes first, at the disk's full rate: the capsule's
            # layers, then the tree's files (about 1 GB for an 8B vLLM) while the layers are
            # unpacked (the one waits on the disk, the other on the CPUs). Queued behind the
            # much larger payload, each of their reads waited for many of its pieces (on a node
            # with nothing prepared the unpacking took 19.5 s instead of 1.6 s).
            if staged_at is None:
                page_cache.cache_capsule_layers([store.blob_path(d.digest) for d in cap.layers], rb, progress)
            progress.step("reading the files the workload maps alongside")
            files_read = in_background(
                page_cache.cache_tree_files, cap.config.units, rb, QUIET, enabled=settings.files_cache, programs=r.driver.program_files(cap.config.units), queued=files_queued.reach,
            )  # fmt: skip
            files_queued.by_end_of(files_read)
        # The payload is copied into memory on a thread of its own, once the files' reads are
        # queued (its own line up behind them), while the capsule is unpacked and the restore runs.
        job = weights_memory.start_staging(cap.config, choice, rb, progress, after=files_queued.future) if stages_payload and choice is not None else None
        if job is not None:
            attempt.on_failure(job.discard)
        if staged_at is None:
            staging = new_restore_staging(store, unpacked_size(cap))
            attempt.on_failure(lambda: paths.remove_staging(staging))
            unpack_capsule(store, cap, staging, rb, progress)
        else:
            staging = staged_at
            rb.details["staged_ahead"] = True
        image = cap.config.units[0]
        with rb.phase(r.launcher.stage_phase):
            staged = r.launcher.stage(r.driver, image, staging / "units" / image.name, staging=staging, request=req)
        attempt.on_failure(staged.discard)
        rb.details.update(staged.details)
        if files_read is not None:
            files_read.result()
        else:
            page_cache.cache_tree_files(cap.config.units, rb, progress, enabled=settings.files_cache, background=background, programs=r.driver.program_files(cap.config.units))
        if job is not None and background:
            # A node with nothing prepared: the restore goes ahead while the copy goes on;
            # hydration follows it (fill marks), or waits for it (phase hydrate.wait).
            choice = dataclasses.replace(choice, pending=job) if choice is not None else None
        elif job is not None:
            choice = job.result()
            attempt.on_failure(choice.release_memory)
        if choice is not None and choice.in_memory is None and choice.pending is None:
            choice = page_cache.cache_for_restore(cap.config, choice, req.workload.model.path, rb, progress, enabled=settings.weights_cache, background=background)
        return PreparedRestore(req, cap, r, settings, rb, staged, prepare_seconds=time.monotonic() - t, weights=choice, held_by_replaced=held)


def unpacked_size(cap: Capsule) -> int:
    return sum(int((d.annotations or {}).get(media.A_UNPACKED_SIZE, d.size)) for d in cap.layers)


def unpack_capsule(store: CapsuleStore, cap: Capsule, staging: Path, rb: ReceiptBuilder, progress: Progress) -> None:
    """Verify and unpack every layer of *cap* into *staging*."""
    with rb.phase("prepare.stage"), progress.transfer("verifying and unpacking capsule %s" % (cap.ref or cap.digest), sum(d.size for d in cap.layers)) as tick:
        for d in cap.layers:
            unpack_layer(store, d, staging / "units", tick=tick)


def activate_restore(prepared: PreparedRestore, *, log_path: Path, progress: Progress = QUIET) -> ServingOutcome:
    """Restore the staged capsule, bring its weights back, validate: a running, validated workload."""
    rb, req, cap, r = prepared.receipt, prepared.request, prepared.capsule, prepared.resolved
    w = req.workload
    try:
        with settings_mod.using(prepared.settings), Attempt(rb) as attempt:
            holder = None if prepared.restored_ahead else port_holder_settled(w.launch.port)
            if holder:
                raise RestoreError("port %d is in use by %s: stop that workload before restoring" % (w.launch.port, holder))
            t0, faults = time.monotonic(), major_faults.of_self()
            with rb.phase("restore"):
                running = attempt.running = prepared.staged.activate(req.workload_name, log_path=log_path, progress=progress.step)
                root_pid = running.root_pid
            rb.details.update(prepared.staged.details)
            endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
            h = None
            if prepared.weights is not None:
                choice = prepared.weights
                filling = choice.pending.early() if choice.pending is not None else None
                if choice.pending is not None and filling is None:  # ended before its files existed
                    with rb.phase("hydrate.wait"):
                        choice = choice.settled()
                memory = filling or choice.in_memory
                with rb.phase("hydrate"), progress.waiting("hydrating weights (%s)" % choice.path):
                    h = r.adapter.hydrate(
                        endpoint, path=choice.path, model_dir=w.model.path or "", native_dir=str(choice.native_dir) if choice.native_dir else None, cached=choice.cached,
                        memory_dir=str(memory.directory) if memory is not None else None, filling=choice.copied_whole if filling is not None else None,
                    )  # fmt: skip
                choice = choice.settled()
                source = weight_paths.source_files(cap.config, choice.path)
                rb.weights = Weights(path=h.path, seconds=round(h.seconds, 4), files=len(source), bytes=sum(f.size for f in source), note=choice.note)
                if h.details:
                    rb.details["hydrate"] = list(h.details)
            elif r.driver.engine_loads_weights:
                # Past its boundary the engine initializes the accelerator and loads its weights itself.
                with rb.phase("engine_init"), progress.waiting("engine initializing after the %s driver's boundary" % r.driver.name):
                    r.adapter.wait_ready(endpoint, alive=running.alive, timeout=req.ready_timeout_seconds)
                rb.weights = Weights(path="engine-load")
            else:
                rb.weights = Weights(path="in-image")
            expected = req.validation.expected_reply or cap.config.validation.reply
            with rb.phase("validate"):
                validation = validate(r, endpoint, req, t0, expected)
            rb.validation = validation
            rb.details["activation_major_faults"] = major_faults.of_self() - faults  # this process's waits on the disk, on the clock
            if not validation.passed:
                raise ValidationError("restored workload replied %r, capsule %s recorded %r: the capsule does not match this host; recapture" % (validation.reply, req.capsule.ref, expected))
            if h is not None and prepared.weights is not None:
                _after_hydration(r, endpoint, h, prepared.weights, rb)
            rb.details["prepare_seconds"] = round(prepared.prepare_seconds, 4)
            rb.details["root_pid"] = root_pid
            engine_temp.sweep()  # what the workload this one replaced left in /tmp
            return ServingOutcome(finish(rb, None), root_pid, validation.ttft_seconds, running)
    finally:
        prepared.discard()


def _after_hydration(r: Resolved, endpoint: Endpoint, hydrated: HydrationResult, choice: weight_paths.WeightChoice, rb: ReceiptBuilder) -> None:
    """Once the engine has answered, off the clock: what the hydration kept for speed (the
    payload's mapping, still registered with the GPU) is let go, then the copy in memory.
    The workload serves either way: a failure here is recorded, not raised."""
    with rb.phase("hydrate.release"):
        try:
            released = r.adapter.finish_hydration(endpoint, hydrated)
        except ColdsnapError as err:
            rb.details["hydrate_release_error"] = err.message
            released = ()
        choice.release_memory()
    if released:
        rb.details["hydrate_release"] = list(released)
