"""Every unit of a capsule of several units restored, each on its own host, as one workload.

The checkpoint's barriers, walked back; each step runs on every unit (on its host, all hosts
at once) before the next step runs on any:

1. hold back: every host drops the packets arriving for its unit's connections to the other
   hosts (``host/peer_lock.py``), so no end restored early meets a peer not yet restored;
2. restore: every unit's tree restored by CRIU on its host; it comes back stopped at the cut
   (it was stopped when it was dumped), in the host's namespaces with its captured PIDs and
   addresses, its connections to the other hosts' units with it; once every unit is back,
   every host lets its connections' packets through again;
3. adopt: every restored root recorded as its rank (from here the manager sees and stops it);
4. continue: every unit continued (SIGCONT), now that every end of every connection is back;
5. devices, for drivers with device state apart from the images (n610): every unit's device
   users get their devices back, still locked, then every unit's are unlocked. The driver's
   calls are carried out by threads of the processes themselves, so they come after the
   continue; and no rank may compute before every rank has its device memory back, or a
   collective would wait on a peer that has none.

A failure stops at the barrier it happened at and is raised; the caller ends every tree
restored (*roots* is filled as each unit's restore returns, so a failure on another host
still finds them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host.threads import ContextPool


class RestoreSteps(Protocol):
    """How one restore reaches the units' hosts."""

    def lock_network(self, u: LaunchUnit) -> None:
        """Hold back the packets arriving for the unit's connections to other hosts."""
        ...

    def unlock_network(self, u: LaunchUnit) -> None:
        """Let them through again."""
        ...

    def restore(self, u: LaunchUnit) -> int:
        """Restore the unit's tree on its host, stopped at the cut; its root's PID."""
        ...

    def adopt(self, u: LaunchUnit, root: int) -> None:
        """Record the restored tree as the unit's rank (the manager's records)."""
        ...

    def resume(self, u: LaunchUnit, root: int) -> None:
        """Continue the unit's process group."""
        ...

    def restore_devices(self, u: LaunchUnit) -> None:
        """Give the unit's device users their devices back, left locked."""
        ...

    def unlock_devices(self, u: LaunchUnit) -> None: ...


@dataclass
class CoordinatedRestore:
    """Per unit, the seconds of each phase; per barrier, the seconds the coordinator waited."""

    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    barriers: dict[str, float] = field(default_factory=dict)


def restore_units(steps: RestoreSteps, units: Sequence[LaunchUnit], roots: dict[str, int], *, devices: bool) -> CoordinatedRestore:
    """Restore, adopt, continue every unit, then give every unit its devices back and unlock
    them all (see the module docstring); *roots* gets each unit's restored root by name."""
    out = CoordinatedRestore()
    with ContextPool(max_workers=max(1, len(units))) as pool:

        def restored(u: LaunchUnit) -> None:
            roots[u.name] = steps.restore(u)

        try:
            _every(pool, units, steps.lock_network, out, "network_lock", "network_held")
            _every(pool, units, restored, out, "restore", "restored")
        except BaseException:
            # Lifted on every host even when a unit did not come back (the hosts serve other
            # connections too); the failure to tell is the first one.
            with contextlib.suppress(ColdsnapError):
                _every(pool, units, steps.unlock_network, out, "network_unlock", "network_open")
            raise
        _every(pool, units, steps.unlock_network, out, "network_unlock", "network_open")
        _every(pool, units, lambda u: steps.adopt(u, roots[u.name]), out, "adopt", "adopted")
        _every(pool, units, lambda u: steps.resume(u, roots[u.name]), out, "continue", "continued")
        if devices:
            _every(pool, units, steps.restore_devices, out, "device_restore", "devices_restored")
            _every(pool, units, steps.unlock_devices, out, "unlock", "unlocked")
    return out


def _every(pool: ThreadPoolExecutor, units: Sequence[LaunchUnit], step: Callable[[LaunchUnit], Any], out: CoordinatedRestore, phase: str, barrier: str) -> None:
    """*step* on every unit at once; every unit's outcome waited for, then the first failure raised."""
    t = time.monotonic()
    futures = {u.name: pool.submit(_timed, step, u) for u in units}
    errors: list[ColdsnapError] = []
    for u in units:
        try:
            out.phases.setdefault(u.name, {})[phase] = futures[u.name].result()
        except ColdsnapError as err:
            errors.append(err)
    out.barriers[barrier] = time.monotonic() - t
    if errors:
        raise errors[0]


def _timed(step: Callable[[LaunchUnit], Any], u: LaunchUnit) -> float:
    t = time.monotonic()
    step(u)
    return time.monotonic() - t
