"""The one place that decides the order of the barriers across hosts: a capture's cut and a
restore's walk back over it, and how a step runs on every unit at once.

Checkpoint. Every unit of a workload on several hosts checkpointed at one consistent cut, or none.

The ranks' connections come back only when both ends of each are restored from dumps of one
moment, so the units are checkpointed in barriers; each step runs on every unit (on its own
host) before the next step runs on any:

0. devices (drivers with device state apart from the process images, n610): every unit's
   device users are locked, then every unit's device state is checkpointed into host memory.
   A rank still computing while a peer on another host is frozen could start a collective
   that waits on the frozen peer forever, so no unit is checkpointed before every unit is
   locked. This comes before the quiesce: the driver's calls are carried out by threads of
   the processes themselves, which a stopped process does not run;
1. quiesce: every unit's process group is stopped (SIGSTOP) on its host before any is dumped,
   so no rank sends between the first dump and the last;
2. dump: every unit is dumped on its own host, all at once;
3. resume: every unit is continued (SIGCONT) and its devices put back to running, whether
   every dump succeeded or not; a capture, which stops the workload after its checkpoint,
   passes ``resume=False``: its dumps end the trees while they are still stopped at the cut.
   A failed checkpoint still resumes every unit whose tree runs, its devices first given
   back (in the restore order: restore, then unlock), then continued.

A unit whose host stops answering or whose step fails makes the whole checkpoint fail, in one
line naming the host and the unit; the others are put back as they were and nothing their
dumps wrote is kept. The result has each unit's phases and the time spent at each barrier
(the slowest unit sets it).

Restore. Every unit of a capsule of several units restored, each on its own host, as one workload.

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
still finds them)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError
from sparkrun_coldsnap.host.threads import ContextPool


def on_every_unit[T](units: Sequence[LaunchUnit], step: Callable[[LaunchUnit], T]) -> dict[str, T]:
    """*step* of every unit at once, by unit name; every unit's outcome waited for, then the first failure raised."""
    with ContextPool(max_workers=max(1, len(units))) as pool:
        futures = {u.name: pool.submit(step, u) for u in units}
        out: dict[str, T] = {}
        errors: list[ColdsnapError] = []
        for u in units:
            try:
                out[u.name] = futures[u.name].result()
            except ColdsnapError as err:
                errors.append(err)
    if errors:
        raise errors[0]
    return out


@dataclass(frozen=True)
class UnitOnHost:
    """A unit to checkpoint: its name, host, the root of its tree (which leads its process
    group, as the local executor's ``setsid`` makes it) and its images directory there."""

    unit: str
    host: str
    root_pid: int
    images: str


class Cut(Protocol):
    """How one checkpoint reaches the units' hosts."""

    def stop(self, u: UnitOnHost) -> None: ...

    def dump(self, u: UnitOnHost) -> Any:
        """Dump the (stopped) tree into ``u.images``, leaving it there; what the dump recorded."""
        ...

    def resume(self, u: UnitOnHost) -> None: ...

    def discard(self, u: UnitOnHost) -> None:
        """Remove what the unit's dump wrote."""
        ...


class DeviceSteps(Protocol):
    """A unit's device state, checkpointed apart from its process images (the n610 driver's
    CUDA processes), each step on the unit's own host."""

    def lock(self, u: UnitOnHost) -> Any:
        """Lock the unit's device users (a failure lets go of those it locked); what a restore
        needs of them."""
        ...

    def checkpoint(self, u: UnitOnHost) -> None:
        """Move the locked device state into host memory (a failure puts the unit's back)."""
        ...

    def put_back(self, u: UnitOnHost, state: str) -> list[str]:
        """Back to running after a failed cut, from *state* (``locked``, ``checkpointed`` or
        ``unknown``: settle each by what the driver reports); the problems."""
        ...


@dataclass
class CoordinatedCheckpoint:
    """Per unit, the seconds of each phase, what its dump recorded and what its device lock
    recorded; per barrier, the seconds the coordinator waited."""

    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    barriers: dict[str, float] = field(default_factory=dict)
    dumped: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, Any] = field(default_factory=dict)


def checkpoint_units(cut: Cut, units: Sequence[UnitOnHost], *, resume: bool = True, devices: DeviceSteps | None = None) -> CoordinatedCheckpoint:
    """Lock and checkpoint every unit's devices, quiesce every unit, dump every unit, resume
    every unit (see the module docstring)."""
    out = CoordinatedCheckpoint()
    stopped: list[UnitOnHost] = []
    held: dict[str, str] = {}  # unit -> what is known of its device state
    failure: ColdsnapError | None = None
    problems: list[str] = []
    with ContextPool(max_workers=max(1, len(units))) as pool:
        try:
            if devices is not None:
                _every_unit_of_cut(pool, units, devices.lock, out, "lock", "locked", out.devices, held, after="locked")
                _every_unit_of_cut(pool, units, devices.checkpoint, out, "device_checkpoint", "checkpointed", {}, held, after="checkpointed")
            t0 = time.monotonic()
            for u in units:
                t = time.monotonic()
                try:
                    cut.stop(u)
                except ColdsnapError as err:
                    raise CaptureError("quiescing unit %s on host %s failed: %s" % (u.unit, u.host, err)) from err
                stopped.append(u)
                out.phases.setdefault(u.unit, {})["quiesce"] = time.monotonic() - t
            out.barriers["quiesced"] = time.monotonic() - t0
            _every_unit_of_cut(pool, units, cut.dump, out, "dump", "dumped", out.dumped, {})
        except ColdsnapError as err:
            failure = err
        finally:
            t2 = time.monotonic()
            if resume or failure is not None:
                # A capture's dump ended its tree: only the trees that still run are put back.
                running = [u for u in units if resume or u.unit not in out.dumped]
                for u in (u for u in stopped if u in running):
                    try:
                        cut.resume(u)
                    except ColdsnapError as err:
                        problems.append("unit %s on host %s: %s" % (u.unit, u.host, err))
                if devices is not None:
                    problems += _put_back(pool, devices, [u for u in running if u.unit in held], held)
            out.barriers["resumed"] = time.monotonic() - t2
    if failure is not None:
        for u in units:  # a partial set of images is no checkpoint
            try:
                cut.discard(u)
            except ColdsnapError as err:
                problems.append("removing %s on host %s: %s" % (u.images, u.host, err))
        extra = "; resuming failed for %s" % "; ".join(problems) if problems else ""
        told = "every unit was resumed as it was" if resume else "every unit still running was resumed"
        if devices is not None:
            told += " with its devices back to running"
        raise CaptureError("%s; %s and nothing was kept%s" % (failure.message, told, extra)) from failure
    if problems:
        raise CaptureError("every unit was dumped, but resuming failed for %s" % "; ".join(problems))
    return out


def _every_unit_of_cut(
    pool: ContextPool, units: Sequence[UnitOnHost], step: Callable[[UnitOnHost], Any], out: CoordinatedCheckpoint, phase: str, barrier: str,
    results: dict[str, Any], held: dict[str, str], *, after: str | None = None,
) -> None:  # fmt: skip
    """*step* on every unit at once, what each returned put in *results* by unit; every unit's
    outcome waited for (the barrier), then the first failure raised. *held* learns each unit's
    device state: *after* where the step succeeded, ``unknown`` where it failed (the host rolled
    back what it could, or did not answer)."""
    t = time.monotonic()
    futures = {u.unit: pool.submit(_timed, step, u) for u in units}
    errors: list[ColdsnapError] = []
    for u in units:
        try:
            results[u.unit], out.phases.setdefault(u.unit, {})[phase] = futures[u.unit].result()
            if after is not None:
                held[u.unit] = after
        except ColdsnapError as err:
            errors.append(err)
            if after is not None:
                held[u.unit] = "unknown"
    out.barriers[barrier] = time.monotonic() - t
    if errors:
        raise CaptureError(str(errors[0])) from errors[0]


def _put_back(pool: ContextPool, devices: DeviceSteps, units: Sequence[UnitOnHost], held: dict[str, str]) -> list[str]:
    """Every unit's devices back to running, all hosts at once; the problems, naming each unit."""
    futures = {u.unit: pool.submit(devices.put_back, u, held[u.unit]) for u in units}
    problems = []
    for u in units:
        try:
            problems += ["unit %s on host %s: %s" % (u.unit, u.host, p) for p in futures[u.unit].result()]
        except ColdsnapError as err:  # the steps name the unit and its host
            problems.append(str(err))
    return problems


def _timed(step: Callable[[UnitOnHost], Any], u: UnitOnHost) -> tuple[Any, float]:
    t = time.monotonic()
    recorded = step(u)
    return recorded, time.monotonic() - t


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
            _every_unit_restored(pool, units, steps.lock_network, out, "network_lock", "network_held")
            _every_unit_restored(pool, units, restored, out, "restore", "restored")
        except BaseException:
            # Lifted on every host even when a unit did not come back (the hosts serve other
            # connections too); the failure to tell is the first one.
            with contextlib.suppress(ColdsnapError):
                _every_unit_restored(pool, units, steps.unlock_network, out, "network_unlock", "network_open")
            raise
        _every_unit_restored(pool, units, steps.unlock_network, out, "network_unlock", "network_open")
        _every_unit_restored(pool, units, lambda u: steps.adopt(u, roots[u.name]), out, "adopt", "adopted")
        _every_unit_restored(pool, units, lambda u: steps.resume(u, roots[u.name]), out, "continue", "continued")
        if devices:
            _every_unit_restored(pool, units, steps.restore_devices, out, "device_restore", "devices_restored")
            _every_unit_restored(pool, units, steps.unlock_devices, out, "unlock", "unlocked")
    return out


def _every_unit_restored(pool: ContextPool, units: Sequence[LaunchUnit], step: Callable[[LaunchUnit], Any], out: CoordinatedRestore, phase: str, barrier: str) -> None:
    """*step* on every unit at once; every unit's outcome waited for, then the first failure raised."""
    t = time.monotonic()
    futures = {u.name: pool.submit(_timed_step, step, u) for u in units}
    errors: list[ColdsnapError] = []
    for u in units:
        try:
            out.phases.setdefault(u.name, {})[phase] = futures[u.name].result()
        except ColdsnapError as err:
            errors.append(err)
    out.barriers[barrier] = time.monotonic() - t
    if errors:
        raise errors[0]


def _timed_step(step: Callable[[LaunchUnit], Any], u: LaunchUnit) -> float:
    t = time.monotonic()
    step(u)
    return time.monotonic() - t
