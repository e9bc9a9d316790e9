"""One record per managed workload on disk, and the lock that makes its transitions one at a time.

``<COLDSNAP_HOME>/run/lifecycle/<workload>.json`` (or under ``COLDSNAP_LIFECYCLE_DIR``) says what the workload is (its recipe, engine,
driver, port, the capsule it came from), its state and since when, and, while a verb runs, the
transition in flight with the PID running it. It is replaced atomically (written aside, renamed),
so a reader sees the state before or after a write, never half of one.

``<workload>.lock`` is held (``flock``) for the whole of a transition: a second verb on the same
workload is refused at once, naming the one running. The kernel drops the lock with its holder,
so a crashed transition leaves the lock free and its transition recorded: the next command settles it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.strict import Strict, one_line
from sparkrun_coldsnap.errors import ColdsnapError, NotFoundError, RequestError, StoreError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.atomic import write_bytes
from sparkrun_coldsnap.host.file_lock import Timeout, file_lock
from sparkrun_coldsnap.lifecycle.states import State

RECORD_FORMAT = 1


class Transition(Strict):
    verb: str
    source: State
    target: State
    pid: int = Field(description="The process running the transition (the next command settles it when that process is gone).")
    started_at: str


class WarmRestore(Strict):
    """A restore prepared ahead: the staged images and until when they are kept."""

    capsule_ref: str
    capsule_digest: str
    staging: str = Field(description="The staging directory (removed when the restore is released or activated).")
    images: str = Field(description="The unit's unpacked images inside the staging.")
    weights_cached: bool = False
    expires_at: str
    tree_pid: int | None = Field(
        default=None, description="On GPU drivers: the root of the process tree restored ahead (GPU state back, weights not hydrated); activation only hydrates and validates it.",
    )  # fmt: skip


class WorkloadRecord(Strict):
    format: int = RECORD_FORMAT
    workload: str = Field(description="sparkrun's name of the workload (its local executor's record).")
    recipe: str
    hosts: tuple[str, ...] | None = None
    cluster: str | None = None
    capsule_name: str = Field(description="The recipe's capsule name (the hibernation capsule is a tag of it).")
    store: str
    engine: str
    driver: str
    executor: str
    port: int
    served_model: str
    model_dir: str | None = None
    state: State
    since: str
    root_pid: int | None = Field(None, description="The root of the serving process tree (active, sleeping).")
    capsule_ref: str | None = Field(None, description="The capsule the workload came from, or (hibernated, warm) the one that holds it.")
    capsule_digest: str | None = None
    sleep_level: int | None = None
    warm: WarmRestore | None = None
    transition: Transition | None = None
    overrides: dict[str, Any] = Field(default_factory=dict, description="The recipe overrides (-o) the workload was run with.")
    validation_prompt: str
    validation_max_tokens: int
    expected_reply: str | None = Field(None, description="The reply the workload gave when it was validated last; wake must reproduce it.")
    note: str | None = Field(None, description="What the last settled transition left, for people (failed: what to do).")
    last_receipt: str | None = None


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def records_dir() -> Path:
    return settings.current().lifecycle_dir or paths.run_dir() / "lifecycle"


def _safe(workload: str) -> str:
    if not workload or "/" in workload or workload.startswith("."):
        raise RequestError("workload name %r is not a name sparkrun gives a workload: pass the recipe or the name `sparkrun coldsnap status` shows" % workload)
    return workload


def record_path(workload: str) -> Path:
    return records_dir() / ("%s.json" % _safe(workload))


def load(workload: str) -> WorkloadRecord | None:
    path = record_path(workload)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StoreError("cannot read the lifecycle record %s: %s" % (path, err.strerror)) from err
    try:
        return WorkloadRecord.model_validate_json(text)
    except PydanticValidationError as err:
        raise StoreError(one_line(err, prefix="lifecycle record %s (remove it: the workload is then unmanaged)" % path)) from err


def require(workload: str) -> WorkloadRecord:
    rec = load(workload)
    if rec is None:
        known = ", ".join(r.workload for r in all_records()) or "none"
        raise NotFoundError("no workload %s is managed here (managed: %s): pass a recipe run with `sparkrun run`, or a name `sparkrun coldsnap status` shows" % (workload, known))
    return rec


def save(rec: WorkloadRecord) -> WorkloadRecord:
    write_bytes(record_path(rec.workload), (json.dumps(rec.model_dump(mode="json"), indent=1) + "\n").encode(), mode=0o640)
    return rec


def find(workload: str) -> WorkloadRecord | None:
    """The record of *workload*, or else of the one workload of the same intent managed here
    (the same recipe, named anew by a status-aware scheduler's plan); None when none or several."""
    rec = load(workload)
    if rec is not None:
        return rec
    others = alike(workload)
    return others[0] if len(others) == 1 else None


def alike(workload: str) -> list[WorkloadRecord]:
    """The records of workloads of *workload*'s intent, whatever placement token names them."""
    from sparkrun_coldsnap.integration.records import same_intent

    return [r for r in all_records() if same_intent(workload, r.workload)]


def remove(workload: str) -> None:
    record_path(workload).unlink(missing_ok=True)


def all_records() -> list[WorkloadRecord]:
    out = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            rec = load(path.stem)
        except ColdsnapError:
            continue  # a damaged record is named when that workload is asked for
        if rec is not None:
            out.append(rec)
    return out


class Busy(RequestError):
    """Another transition holds the workload."""

    code = "lifecycle.busy"
    exit_code = 5


@contextlib.contextmanager
def locked(workload: str) -> Iterator[None]:
    """Hold *workload*'s lock, or refuse at once naming the transition that holds it.

    Reentrant in the process: a verb that drives ``sparkrun run`` (wake) holds the workload's
    lock while sparkrun's strategy, in the same process, asks for it again."""
    path = records_dir() / ("%s.lock" % _safe(workload))
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = file_lock(path, mode=0o640, per_thread=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        rec = load(workload)
        t = rec.transition if rec else None
        doing = "a %s (%s -> %s, pid %d, since %s)" % (t.verb, t.source, t.target, t.pid, t.started_at) if t else "another command"
        raise Busy("workload %s is busy: %s is running on it; wait for it to finish, then try again" % (workload, doing)) from None
    try:
        yield
    finally:
        lock.release()
