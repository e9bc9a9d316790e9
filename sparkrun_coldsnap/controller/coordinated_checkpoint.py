"""Every unit of a workload on several hosts checkpointed at one consistent cut, or none.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparkrun_coldsnap.errors import CaptureError, ColdsnapError
from sparkrun_coldsnap.host.threads import ContextPool


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
                _every(pool, units, devices.lock, out, "lock", "locked", out.devices, held, after="locked")
                _every(pool, units, devices.checkpoint, out, "device_checkpoint", "checkpointed", {}, held, after="checkpointed")
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
            _every(pool, units, cut.dump, out, "dump", "dumped", out.dumped, {})
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


def _every(
    pool: ThreadPoolExecutor, units: Sequence[UnitOnHost], step: Callable[[UnitOnHost], Any], out: CoordinatedCheckpoint, phase: str, barrier: str,
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


def _put_back(pool: ThreadPoolExecutor, devices: DeviceSteps, units: Sequence[UnitOnHost], held: dict[str, str]) -> list[str]:
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
