"""What a capture refuses before anything starts, written once for one unit, several units and
a live workload: the driver on the hosts it runs on, and the pinned snapshot the capsule binds to."""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.compat import pinning
from sparkrun_coldsnap.documents.request import Workload
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.engines.base import EngineAdapter
from sparkrun_coldsnap.errors import CaptureError, RequestError
from sparkrun_coldsnap.host.facts import host_facts
from sparkrun_coldsnap.units.resolved import Resolved, resolve


def admit_snapshot(w: Workload, adapter: EngineAdapter, *, launches: bool = True) -> Path:
    """The capsule is bound to the files of the pinned snapshot: the engine must be told that
    revision (where this capture launches it; a live engine's loaded files are compared with the
    snapshot's when they are recorded) and its files must be in the model cache; their directory."""
    if launches:
        problem = pinning.launch_problem(w, adapter)
        if problem:
            raise RequestError(problem)
    if not w.model.path:
        raise RequestError("the pinned snapshot of %s@%s is not in the model cache (HF_HOME): a capsule is bound to the files of that snapshot; download that revision first" % (w.model.id, w.model.revision))
    return Path(w.model.path)


def unpinned_vanilla(w: Workload) -> str | None:
    """What a vanilla start of *w* should say of its serve command: capture refuses a command
    that does not load exactly the pinned revision, a vanilla start runs it as written; None when
    the command loads the pinned revision (or the engine is not one this plugin knows)."""
    try:
        adapter = extensions.registry().engine(w.engine)
    except RequestError:
        return None
    problem = pinning.launch_problem(w, adapter)
    if problem is None:
        return None
    return "started as the recipe says, though a capture refuses it: %s" % problem


def admit_driver_here(r: Resolved) -> None:
    """The snapshot driver can capture on this host (its kernel, tools and devices)."""
    support = r.driver.support(host_facts())
    if not support.ok:
        raise CaptureError("snapshot driver %s cannot capture on this host: %s" % (r.driver.name, support.reason))


def resolve_across_hosts(w: Workload, settings: Settings) -> Resolved:
    """The workload's names resolved, refused where its driver cannot checkpoint ranks on several hosts at one cut."""
    r = resolve(w, settings)
    if not r.driver.across_hosts:
        able = [d.name for d in extensions.registry().drivers_by_preference() if d.across_hosts]
        raise RequestError(
            "driver %s cannot capture a workload of several hosts (%s can): set coldsnap.driver to one of those, or capture each host's engine on its own" % (r.driver.name, ", ".join(able)),
            code="request.multi_host",
        )
    return r
