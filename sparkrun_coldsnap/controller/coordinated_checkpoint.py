"""Every unit of a workload on several hosts checkpointed at one consistent cut, or none.

The ranks' connections come back only when both ends of each are restored from dumps of one
moment, so the units are checkpointed in barriers:

1. quiesce: every unit's process group is stopped (SIGSTOP) on its host before any is dumped,
   so no rank sends between the first dump and the last;
2. dump: every unit is dumped on its own host, all at once, the trees left running (CRIU keeps
   a stopped tree stopped);
3. resume: every unit is continued (SIGCONT), whether every dump succeeded or not; a capture,
   which stops the workload after its checkpoint, passes ``resume=False``: its dumps end the
   trees while they are still stopped at the cut (a failed checkpoint still resumes the
   units that run).

A unit whose host stops answering or whose dump fails makes the whole checkpoint fail, in one
line naming the host and the unit; the others are resumed as they were and nothing their
dumps wrote is kept. The result has each unit's phases and the time spent at each barrier
(the slowest unit sets it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparkrun_coldsnap.errors import CaptureError, ColdsnapError


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


@dataclass
class CoordinatedCheckpoint:
    """Per unit, the seconds of each phase and what its dump recorded; per barrier, the seconds
    the coordinator waited."""

    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    barriers: dict[str, float] = field(default_factory=dict)
    dumped: dict[str, Any] = field(default_factory=dict)


def checkpoint_units(cut: Cut, units: Sequence[UnitOnHost], *, resume: bool = True) -> CoordinatedCheckpoint:
    """Quiesce every unit, dump every unit, resume every unit (see the module docstring)."""
    out = CoordinatedCheckpoint()
    stopped: list[UnitOnHost] = []
    failure: ColdsnapError | None = None
    with ThreadPoolExecutor(max_workers=max(1, len(units))) as pool:
        t0 = time.monotonic()
        try:
            for u in units:
                t = time.monotonic()
                try:
                    cut.stop(u)
                except ColdsnapError as err:
                    raise CaptureError("quiescing unit %s on host %s failed: %s" % (u.unit, u.host, err)) from err
                stopped.append(u)
                out.phases.setdefault(u.unit, {})["quiesce"] = time.monotonic() - t
            out.barriers["quiesced"] = time.monotonic() - t0

            t1 = time.monotonic()
            futures = {u.unit: pool.submit(_timed, cut, u) for u in units}
            errors = []
            for u in units:
                try:
                    out.dumped[u.unit], out.phases[u.unit]["dump"] = futures[u.unit].result()
                except ColdsnapError as err:
                    errors.append(err)
            out.barriers["dumped"] = time.monotonic() - t1
            if errors:
                raise CaptureError(str(errors[0])) from errors[0]
        except ColdsnapError as err:
            failure = err
        finally:
            resume_problems = []
            t2 = time.monotonic()
            for u in stopped if (resume or failure is not None) else ():
                try:
                    cut.resume(u)
                except ColdsnapError as err:
                    resume_problems.append("unit %s on host %s: %s" % (u.unit, u.host, err))
            out.barriers["resumed"] = time.monotonic() - t2
    if failure is not None:
        for u in units:  # a partial set of images is no checkpoint
            try:
                cut.discard(u)
            except ColdsnapError as err:
                resume_problems.append("removing %s on host %s: %s" % (u.images, u.host, err))
        extra = "; resuming failed for %s" % "; ".join(resume_problems) if resume_problems else ""
        told = "every unit was resumed as it was" if resume else "every unit still running was resumed"
        raise CaptureError("%s; %s and nothing was kept%s" % (failure.message, told, extra)) from failure
    if resume_problems:
        raise CaptureError("every unit was dumped, but resuming failed for %s" % "; ".join(resume_problems))
    return out


def _timed(cut: Cut, u: UnitOnHost) -> tuple[Any, float]:
    t = time.monotonic()
    recorded = cut.dump(u)
    return recorded, time.monotonic() - t
