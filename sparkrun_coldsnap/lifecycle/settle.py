"""Run a transition under the workload's lock, and settle one a crash interrupted.

A transition is recorded before it starts (verb, from, to, the PID running it) and cleared when
it ends, successful or not. When the next command finds one recorded whose process is gone, it
looks at what is there (the serving tree, the hibernation capsule, the warm staging) and
records the state that is true, with a note saying what happened and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from sparkrun_coldsnap.lifecycle import records
from sparkrun_coldsnap.lifecycle.records import Transition, WorkloadRecord, now_iso
from sparkrun_coldsnap.lifecycle.states import State, move


def process_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class Reality:
    """What is there for an interrupted transition to be judged by."""

    tree_alive: bool
    capsule_present: bool
    staging_present: bool


def observe(rec: WorkloadRecord, capsule_present: Callable[[str], bool]) -> Reality:
    warm = rec.warm
    return Reality(
        tree_alive=process_alive(rec.root_pid),
        capsule_present=bool(rec.capsule_ref) and capsule_present(rec.capsule_ref or ""),
        staging_present=warm is not None and Path(warm.images).is_dir(),
    )


def judge(t: Transition, real: Reality) -> tuple[State, str]:
    """The state an interrupted transition *t* left, given what is there, and what to tell people."""
    head = "a %s (%s -> %s) was interrupted (pid %d is gone)" % (t.verb, t.source, t.target, t.pid)
    if t.verb == "hibernate":
        if real.tree_alive:
            return "active", "%s before the workload stopped: it still serves; hibernate it again" % head
        if real.capsule_present:
            return "hibernated", "%s after its capsule was published: it is hibernated" % head
        return "failed", "%s: the workload is gone and no capsule was published; `sparkrun run` its recipe starts it from its recipe's capsule" % head
    if t.verb == "sleep" or (t.verb == "wake" and t.source == "sleeping"):
        if real.tree_alive:
            return "failed", "%s: the engine still runs, its memory in an unknown state; `sparkrun run` its recipe replaces it, `sparkrun stop` ends it" % head
        return "failed", "%s and the engine is gone; `sparkrun run` its recipe starts it again" % head
    if t.verb in ("wake", "activate"):
        if real.tree_alive:
            return "active", "%s after the workload came back: it serves" % head
        if real.capsule_present:
            return "hibernated", "%s before the workload came back: it is still hibernated; wake it again" % head
        return "failed", "%s and its capsule is gone; `sparkrun run` its recipe starts it again" % head
    # warm and release: nothing runs; the capsule is what holds the workload.
    if real.capsule_present:
        return "hibernated", "%s: the prepared restore was dropped, the workload is still hibernated" % head
    return "failed", "%s and its capsule is gone; `sparkrun run` its recipe starts it again" % head


def settle(rec: WorkloadRecord, capsule_present: Callable[[str], bool], drop_staging: Callable[[str], None]) -> WorkloadRecord:
    """*rec* with an interrupted transition (its process gone) replaced by the state that is true."""
    t = rec.transition
    if t is None or process_alive(t.pid):
        return rec
    state, note = judge(t, observe(rec, capsule_present))
    if rec.warm is not None and state != "warm":
        drop_staging(rec.warm.staging)
    return records.save(
        rec.model_copy(
            update={
                "state": state,
                "since": now_iso(),
                "transition": None,
                "note": note,
                "warm": None if state != "warm" else rec.warm,
                "root_pid": rec.root_pid if state in ("active", "sleeping") or (state == "warm" and rec.warm and rec.warm.tree_pid) else None,
            }
        )  # fmt: skip
    )


class Running:
    """The transition in flight: what it ends in is set by the verb (``done``) or by a failure (``undo``)."""

    def __init__(self, rec: WorkloadRecord) -> None:
        self.rec = rec

    def done(self, **changes) -> WorkloadRecord:
        self.rec = records.save(self.rec.model_copy(update={"transition": None, "since": now_iso(), "note": None, **changes}))
        return self.rec


@contextlib.contextmanager
def transition(
    workload: str, verb: str, *, capsule_present: Callable[[str], bool], drop_staging: Callable[[str], None],
    on_failure: Callable[[WorkloadRecord, BaseException], dict] | None = None,
) -> Iterator[Running]:  # fmt: skip
    """Lock *workload*, settle what a crash left, check the move is allowed, record it, run it.

    A verb that fails cleanly leaves the state its *on_failure* says (by default the one it started
    from, with the error as the note): the record never keeps a transition its process finished.
    """
    import os

    with records.locked(workload):
        rec = settle(records.require(workload), capsule_present, drop_staging)
        m = move(verb, rec.state, workload=workload)
        rec = records.save(rec.model_copy(update={"transition": Transition(verb=verb, source=m.source, target=m.target, pid=os.getpid(), started_at=now_iso())}))
        running = Running(rec)
        try:
            yield running
        except BaseException as err:
            changes = on_failure(running.rec, err) if on_failure else {}
            note = "%s failed: %s" % (verb, err)
            records.save(running.rec.model_copy(update={"transition": None, "note": note, **changes}))
            raise
        if running.rec.transition is not None:
            raise AssertionError("the %s verb ended without recording its state" % verb)
