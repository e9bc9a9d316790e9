"""The restore's steps for one unit on this host (``restore.RestoreUnits``): admitted with this
host's fingerprint, its weights made ready in memory or the page cache while its layers are
unpacked, staged and brought back by the workload's launcher (a host process or a container),
hydrated through the engine."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule_crypto, engine_caches, media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat.admission import admission
from sparkrun_coldsnap.controller.common import Attempt, require_one_unit
from sparkrun_coldsnap.controller.restore import PreparedRestore, Preparing, open_trusted, refuse_driver
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Weights
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.engines.base import Endpoint, HydrationResult
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, RestoreError
from sparkrun_coldsnap.host import engine_temp, paths
from sparkrun_coldsnap.host.atomic import owned_prefix
from sparkrun_coldsnap.host.background import Milestone, in_background
from sparkrun_coldsnap.host.ports import port_holder_settled
from sparkrun_coldsnap.launch.base import RunningUnit, StagedUnit
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved, resolve
from sparkrun_coldsnap.weights import page_cache, weight_paths, weights_memory


class HereRestore:
    """One launch unit on this host.

    *replacing* is the PIDs of the workload this restore replaces: the captured PIDs and shared
    files they hold are freed when it is stopped, which happens after staging and before the
    restore; they are named in the result (``held_by_replaced``) and the receipt, not refused.
    *staged_at*: a staging directory where the capsule's layers were already unpacked and
    verified (a warm restore); admission runs again, the unpacking does not. *staged*: the unit
    already staged (a tree restored ahead), which activation only hands over."""

    told = ""
    replied = "restored workload"
    where = "this host"

    def __init__(self, *, replacing: frozenset[int] = frozenset(), staged_at: Path | None = None, staged: StagedUnit | None = None) -> None:
        self.replacing = replacing
        self.staged_at = staged_at
        self.staged = staged
        self.hydrated: HydrationResult | None = None

    def resolve(self, p: Preparing) -> Resolved:
        require_one_unit(p.req.workload, "restore")
        return resolve(p.req.workload, p.settings)

    def admit(self, p: Preparing) -> tuple[weight_paths.WeightChoice | None, tuple[str, ...]]:
        return admit_here(p.capsule, p.req, p.r, p.rb, replacing=self.replacing, store=p.store)

    def stage(self, p: Preparing, weights: weight_paths.WeightChoice | None) -> weight_paths.WeightChoice | None:
        """The payload copied into memory (or read into the page cache), the layers unpacked and
        the unit staged by its launcher, in the order that keeps the disk busiest."""
        cap, r, rb, settings, progress, attempt, store = p.capsule, p.r, p.rb, p.settings, p.progress, p.attempt, p.store
        choice = weights
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
            if self.staged_at is None:
                page_cache.cache_capsule_layers([store.blob_path(d.digest) for d in cap.layers], rb, progress)
            progress.step("reading the files the workload maps alongside")
            files_read = in_background(
                page_cache.cache_tree_files, cap.config.units, rb, QUIET, enabled=settings.files_cache, programs=r.driver.program_files(cap.config.units), queued=files_queued.reach,
            )  # fmt: skip
            files_queued.by_end_of(files_read)
        # The payload is copied into memory on a thread of its own, once the files' reads are
        # queued (its own line up behind them), while the capsule is unpacked and the restore runs.
        # A container binds the shared tmpfs when it is created: its copy goes there (container_mounts.py).
        shared = r.launcher.executor == "docker"
        job = weights_memory.start_staging(cap.config, choice, rb, progress, after=files_queued.future, shared=shared) if stages_payload and choice is not None else None
        if job is not None:
            attempt.on_failure(job.discard)
        if self.staged_at is None:
            staging = new_restore_staging(store, unpacked_size(cap))
            attempt.on_failure(lambda: paths.remove_staging(staging))
            unpack_capsule(store, cap, staging, rb, progress)
        else:
            staging = self.staged_at
            rb.details["staged_ahead"] = True
        image = cap.config.units[0]
        with rb.phase(r.launcher.stage_phase):
            self.staged = r.launcher.stage(r.driver, image, staging / "units" / image.name, staging=staging, request=p.req)
        attempt.on_failure(self.discard)
        rb.details.update(self.staged.details)
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
            choice = page_cache.cache_for_restore(cap.config, choice, p.req.workload.model.path, rb, progress, enabled=settings.weights_cache, background=background)
        return choice

    def discard(self) -> None:
        if self.staged is not None:
            self.staged.discard()

    def evict(self, prepared: PreparedRestore, attempt: Attempt) -> None:
        # The workload being replaced was stopped by its manager between the two steps.
        port = prepared.request.workload.launch.port
        holder = None if prepared.restored_ahead else port_holder_settled(port)
        if holder:
            raise RestoreError("port %d is in use by %s: stop that workload before restoring" % (port, holder))

    def restore(self, prepared: PreparedRestore, attempt: Attempt, *, log_path: Path | None, progress: Progress) -> RunningUnit:
        assert self.staged is not None and log_path is not None, "a unit here is staged, and logs to a file"
        running = attempt.running = self.staged.activate(prepared.request.workload_name, log_path=log_path, progress=progress.step)
        prepared.receipt.details.update(self.staged.details)
        return running

    def endpoint(self, prepared: PreparedRestore) -> Endpoint:
        w = prepared.request.workload
        return prepared.resolved.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)

    def weights_back(self, prepared: PreparedRestore, running: RunningUnit, endpoint: Endpoint, progress: Progress) -> None:
        rb, r, w = prepared.receipt, prepared.resolved, prepared.request.workload
        if prepared.weights is not None:
            choice = prepared.weights
            filling = choice.pending.early() if choice.pending is not None else None
            if choice.pending is not None and filling is None:  # ended before its files existed
                with rb.phase("hydrate.wait"):
                    choice = choice.settled()
            memory = filling or choice.in_memory
            with rb.phase("hydrate"), progress.waiting("hydrating weights (%s)" % choice.path):
                self.hydrated = h = r.adapter.hydrate(
                    endpoint, path=choice.path, model_dir=w.model.path or "", native_dir=str(choice.native_dir) if choice.native_dir else None, cached=choice.cached,
                    memory_dir=str(memory.directory) if memory is not None else None, filling=choice.copied_whole if filling is not None else None,
                )  # fmt: skip
            choice = choice.settled()
            source = weight_paths.source_files(prepared.capsule.config, choice.path)
            rb.weights = Weights(path=h.path, seconds=round(h.seconds, 4), files=len(source), bytes=sum(f.size for f in source), note=choice.note)
            if h.details:
                rb.details["hydrate"] = list(h.details)
        elif r.driver.engine_loads_weights:
            # Past its boundary the engine initializes the accelerator and loads its weights itself.
            with rb.phase("engine_init"), progress.waiting("engine initializing after the %s driver's boundary" % r.driver.name):
                r.adapter.wait_ready(endpoint, alive=running.alive, timeout=prepared.request.ready_timeout_seconds)
            rb.weights = Weights(path="engine-load")

    def after_validation(self, prepared: PreparedRestore, endpoint: Endpoint) -> None:
        if self.hydrated is not None and prepared.weights is not None:
            after_hydration(prepared.resolved, endpoint, self.hydrated, prepared.weights, prepared.receipt)

    def record(self, prepared: PreparedRestore, running: RunningUnit) -> None:
        prepared.receipt.details["root_pid"] = running.root_pid
        engine_temp.sweep()  # what the workload this one replaced left in /tmp


def new_restore_staging(store: CapsuleStore, unpacked_bytes: int) -> Path:
    """Memory-backed staging when there is room for it, else the store's own."""
    memory = paths.memory_staging(unpacked_bytes)
    if memory is not None:
        return paths.new_memory_staging(memory, owned_prefix("restore-"))
    return store.new_staging_dir("restore-")


def check_admission(cap: Capsule, req: RestoreRequest, r: Resolved, *, replacing: frozenset[int] = frozenset()) -> tuple[list[str], weight_paths.WeightChoice | None]:
    """Admission of *cap* for *req* on this host, with this host's fingerprint."""
    here = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
    problems, choice = admission(cap.config, req, here, r.driver, r.adapter, replacing=replacing)
    # Encrypted layers: the keys to open them are here, or the restore stops before anything does.
    return [*problems, *capsule_crypto.key_problems(cap, settings_mod.current().decryption_keys)], choice


def admit_here(
    cap: Capsule, req: RestoreRequest, r: Resolved, rb: ReceiptBuilder, *, replacing: frozenset[int] = frozenset(), store: CapsuleStore | None = None,
) -> tuple[weight_paths.WeightChoice | None, tuple[str, ...]]:  # fmt: skip
    """*cap* admitted here (refused: a CompatibilityError); the weight path, and what the
    workload being replaced (*replacing*) holds that the driver would otherwise refuse. With
    *store*, the engine caches it carries are checked there too (whole, and placeable here)."""
    problems, choice = check_admission(cap, req, r, replacing=replacing)
    if store is not None:
        problems = [*problems, *engine_caches.problems(store, cap.config.request_sha256, cap.config.engine_caches, cap.layers)]
    if problems:
        raise CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, "; ".join(problems)))
    held: tuple[str, ...] = ()
    if replacing:
        held = tuple(p for unit in cap.config.units for p in r.driver.admission(unit) if p not in problems)
    if held:
        rb.details["held_by_replaced_workload"] = list(held)
    tools = r.driver.ready_tools()
    if tools is not None:
        rb.details["restore_tools"] = tools
    return choice, held


def open_and_admit(
    req: RestoreRequest, store: CapsuleStore, settings: Settings, rb: ReceiptBuilder, *, replacing: frozenset[int] = frozenset(),
) -> tuple[Capsule, Resolved, weight_paths.WeightChoice | None, tuple[str, ...]]:  # fmt: skip
    """Open capsule ``req.capsule`` (verified) and admit it here, as a preparation does without
    staging (a tree restored ahead is the staged unit); also what the replaced workload holds."""
    cap = open_trusted(req, store, rb)
    with rb.phase("prepare.admission"):
        require_one_unit(req.workload, "restore")
        r = resolve(req.workload, settings)
        refuse_driver(cap, req, r)
        choice, held = admit_here(cap, req, r, rb, replacing=replacing, store=store)
    return cap, r, choice, held


def unpacked_size(cap: Capsule) -> int:
    return sum(int((d.annotations or {}).get(media.A_UNPACKED_SIZE, d.size)) for d in cap.layers if not engine_caches.is_cache_layer(d))


def unpack_capsule(store: CapsuleStore, cap: Capsule, staging: Path, rb: ReceiptBuilder, progress: Progress) -> None:
    """Verify and unpack every layer of *cap* into *staging* (encrypted ones decrypted there, with
    the keys COLDSNAP_DECRYPTION_KEY names: the store keeps only their ciphertext); the engine's
    caches (a template's) go to the directory the captured engine reads, before it goes on."""
    keys = capsule_crypto.decryption_keys(settings_mod.current().decryption_keys) if capsule_crypto.encrypted_layers(cap) else []
    with rb.phase("prepare.stage"), progress.transfer("verifying and unpacking capsule %s" % (cap.ref or cap.digest), sum(d.size for d in cap.layers)) as tick:
        for d in cap.layers:
            if engine_caches.is_cache_layer(d):
                continue
            unpack_layer(store, d, staging / "units", tick=tick, keys=keys)
        if cap.config.engine_caches is not None:
            rb.details["engine_caches"] = engine_caches.install(store, cap.config.request_sha256, cap.config.engine_caches, cap.layers, tick=tick, keys=keys)


def after_hydration(r: Resolved, endpoint: Endpoint, hydrated: HydrationResult, choice: weight_paths.WeightChoice, rb: ReceiptBuilder) -> None:
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
