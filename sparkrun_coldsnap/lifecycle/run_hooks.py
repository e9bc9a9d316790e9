"""What ``sparkrun run`` of a recipe with a ``coldsnap:`` block asks of the lifecycle.

Before preparation: a hibernated workload is restored from its hibernation capsule (exactly the
state it was hibernated in), a warm one from the images kept for it (only activation is left);
the workload's lock is held from here until activation ends, so no lifecycle verb runs on it
meanwhile. After activation: the workload is recorded active, with what it came from.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.api import PreparedRestore
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.receipts import Receipt
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.lifecycle import records, settle, warm
from sparkrun_coldsnap.lifecycle.records import Transition, WorkloadRecord, now_iso
from sparkrun_coldsnap.lifecycle.states import move
from sparkrun_coldsnap.lifecycle.verbs import capsule_present

#: the locks held between preparation and activation, by workload
_held: dict[str, contextlib.ExitStack] = {}


def before_prepare(req: RestoreRequest, store: CapsuleStore, settings: Settings, say: Any) -> tuple[RestoreRequest, PreparedRestore | None]:
    """The request to prepare (the hibernation capsule's, when hibernated) and, when warm, the prepared restore."""
    name = req.workload_name
    found = records.find(name)  # under a status-aware scheduler the run's name is new
    stack = contextlib.ExitStack()
    stack.enter_context(records.locked(found.workload if found is not None else name))
    _held[name] = stack
    try:
        rec = records.load(found.workload) if found is not None else None
        if rec is None:
            return req, None
        rec = settle.settle(rec, capsule_present(rec), warm.release_dir)
        ref = rec.capsule_ref
        if rec.state not in ("hibernated", "warm") or not ref:
            return req, None
        m = move("activate", rec.state, workload=name)
        if rec.transition is None:  # ``wake`` records its own
            rec = records.save(rec.model_copy(update={"transition": Transition(verb="activate", source=m.source, target=m.target, pid=os.getpid(), started_at=now_iso())}))
        # The hibernation capsule is this host's own capture of the workload, not one from elsewhere:
        # the recipe's trust policy (capsule.trust) is for capsules pulled or copied in.
        req = req.model_copy(update={"trust": None, "capsule": req.capsule.with_tag(CapsuleRef.parse(ref).tag)})
        if rec.state == "warm" and rec.warm is not None and not warm.expired(rec.warm):
            try:
                prepared = warm.claim(rec.warm, req, store=store, settings=settings, workload=rec.workload)
                say("workload %s was warm: restoring from the images kept for it (%s)" % (name, rec.warm.capsule_ref))
                return req, prepared
            except ColdsnapError as err:
                say("the warm restore of %s cannot be used (%s): preparing again" % (name, err))
                warm.release_dir(rec.warm.staging)
                records.save(rec.model_copy(update={"warm": None}))
        say("workload %s was hibernated: restoring %s" % (name, req.capsule.ref))
        return req, None
    except BaseException:
        end(name)
        raise


def activated(
    req: RestoreRequest, receipt: Receipt, root_pid: int, *, recipe: str, hosts: Any, cluster: str | None, overrides: dict[str, Any], store: CapsuleStore,
    receipt_path: Path | None,
) -> None:  # fmt: skip
    """Record *req*'s workload active (the restore or vanilla start that *receipt* describes)."""
    try:
        w = req.workload
        old = records.find(req.workload_name)
        if old is not None and old.warm is not None:
            warm.release_dir(old.warm.staging)  # the restore consumed what it could; the rest goes
        adapter = extensions.registry().engine(w.engine)
        records.save(
            WorkloadRecord(
                workload=req.workload_name, recipe=recipe, hosts=tuple(hosts) if hosts else None, cluster=cluster, overrides=dict(overrides or {}),
                capsule_name=req.capsule.name, store=str(store.root), engine=w.engine, driver=w.driver, executor=w.launch.executor, port=w.launch.port,
                served_model=adapter.served_model(w.launch.command, w.model.id), model_dir=w.model.path, state="active", since=now_iso(), root_pid=root_pid,
                capsule_ref=req.capsule.ref if receipt.capsule else None, capsule_digest=receipt.capsule,
                validation_prompt=req.validation.prompt, validation_max_tokens=req.validation.max_tokens,
                expected_reply=receipt.validation.reply if receipt.validation else None,
                last_receipt=str(receipt_path) if receipt_path else None,
                transition=old.transition if old is not None and old.transition is not None and old.transition.verb == "wake" else None,
            )
        )  # fmt: skip
        if old is not None and old.workload != req.workload_name:
            records.remove(old.workload)  # the same workload, named anew by this run's plan
    finally:
        end(req.workload_name)


def failed(req: RestoreRequest) -> None:
    """An activation that failed: what the record says is settled against what is there."""
    try:
        rec = records.find(req.workload_name)
        if rec is not None and rec.transition is not None and rec.transition.verb == "activate":
            state = "hibernated" if capsule_present(rec)(rec.capsule_ref or "") else "failed"
            if rec.warm is not None:
                warm.release_dir(rec.warm.staging)
            records.save(rec.model_copy(update={"transition": None, "state": state, "warm": None, "note": "sparkrun run failed to bring it back; it is %s" % state}))
    finally:
        end(req.workload_name)


def end(workload: str) -> None:
    stack = _held.pop(workload, None)
    if stack is not None:
        stack.close()
