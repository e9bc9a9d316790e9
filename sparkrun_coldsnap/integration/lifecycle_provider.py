"""The lifecycle as sparkrun 0.4.2's workload-lifecycle provider (``register_workload_lifecycle``).

sparkrun's integration API (``sparkrun.api.workloads``: ``inventory``, ``control`` with ``status``,
``sleep`` and ``wake``, and ``ensure_ready``, which wakes a sleeping or warm workload before it
launches another) asks the provider that claims a job. This one claims the jobs whose workload
the plugin has a lifecycle record of. ``sparkrun status`` (the command) does not ask providers.

``wake`` of a hibernated or warm workload is left to sparkrun's own launch, which ``ensure_ready``
runs next and whose strategy restores exactly that state: a provider's control runs while
sparkrun holds its resource reservation, inside which another launch cannot start.
"""

from __future__ import annotations

from typing import Any

from sparkrun_coldsnap.lifecycle import records, verbs


def workload_of(job: Any) -> str:
    from sparkrun.orchestration.executors._base import Executor

    return Executor.container_name(str(job.workload_id), "solo")


def matches(job: Any) -> bool:
    try:
        return records.load(workload_of(job)) is not None
    except Exception:  # noqa: BLE001 - a record nobody can read claims nothing
        return False


def control(action: str, job: Any, *, sctx: Any = None) -> dict[str, Any]:
    name = workload_of(job)
    rec = records.require(name)
    if action == "sleep":
        rec, _ = verbs.sleep(name)
    elif action == "wake" and rec.state == "sleeping":
        rec, _ = verbs.wake(name)
    elif action not in ("status", "wake"):
        raise ValueError("coldsnap's lifecycle has no action %r" % action)
    return {"workload_id": str(job.workload_id), "state": rec.state}


def register() -> None:
    from sparkrun.core.plugin_identity import current_registration_owner
    from sparkrun.plugins import WorkloadLifecycleProvider, register_workload_lifecycle

    owner = current_registration_owner()
    register_workload_lifecycle(WorkloadLifecycleProvider(name=getattr(owner, "plugin_id", "coldsnap"), matches=matches, control=control))
