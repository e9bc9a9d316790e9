"""The hosts of a multi-unit workload through sparkrun: its executor starts and stops the ranks,
its transport runs each unit's typed steps (:mod:`sparkrun_coldsnap.units.steps`) on the
unit's host, through the agent there (:mod:`sparkrun_coldsnap.integration.unit_agent`), and
carries the layers between that host and the capsule store.

What the controller's multi-unit stories ask of hosts (``launch/remote.UnitHosts``), so
those stories never see SSH, sparkrun or the executor.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import ColdsnapError, IntegrityError, RequestError, ToolError
from sparkrun_coldsnap.host import log_cause
from sparkrun_coldsnap.integration.ranks import RankRecord, Ranks, dead_ranks, wait_rendezvous
from sparkrun_coldsnap.integration.records import intent_pattern
from sparkrun_coldsnap.launch.remote import Tick
from sparkrun_coldsnap.units import remote
from sparkrun_coldsnap.units.step import Answer, Step
from sparkrun_coldsnap.units.steps import AbortConnectionsStep, AdoptStep, RecordedStep, RootStep

CHUNK = 64 << 20  # bytes per read of a remote file: a layer never sits whole in memory
AGENT = "sparkrun_coldsnap.integration.unit_agent"


class SparkrunUnitHosts:
    """:class:`~sparkrun_coldsnap.launch.remote.UnitHosts` over sparkrun's session and executor."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.hosts = ranks.hosts
        self.python = settings_mod.current().host_python or sys.executable

    # -- reaching hosts --------------------------------------------------------------------

    def check_reachable(self, units: Sequence[LaunchUnit]) -> None:
        for u in units:
            try:
                self.hosts.run(u.host, ["true"], timeout=30)
            except ColdsnapError as err:
                raise ToolError("host %s (unit %s) cannot be reached: %s" % (u.host, u.name, err.message), code="host.unreachable") from err

    def listening(self, unit: LaunchUnit, port: int) -> bool:
        return self.ranks.listening(unit.host, port)

    def call[A: Answer](self, unit: LaunchUnit, step: Step[A], *, timeout: float = 900.0) -> A:
        done = self.hosts.run(unit.host, [self.python, "-m", AGENT], input=remote.request(step), timeout=timeout, check=False)
        return remote.answer(step, done.stdout, unit=unit.name, host=unit.host, returncode=done.returncode, tail=done.tail())

    # -- files ---------------------------------------------------------------------------------

    def fetch(self, unit: LaunchUnit, remote: str, local: Path, *, digest: str, size: int, tick: Tick | None = None) -> None:
        h = hashlib.sha256()
        with open(local, "wb") as out:
            for offset in range(0, size, CHUNK):
                try:
                    data = self.hosts.read_range(unit.host, remote, offset, min(CHUNK, size - offset))
                except ColdsnapError as err:
                    raise ToolError("copying a layer of unit %s from host %s failed: %s" % (unit.name, unit.host, err.message)) from err
                h.update(data)
                out.write(data)
                if tick is not None:
                    tick(len(data))
        if "sha256:" + h.hexdigest() != digest or local.stat().st_size != size:
            local.unlink(missing_ok=True)
            raise IntegrityError("layer %s from host %s (unit %s) arrived damaged: copy again" % (remote, unit.host, unit.name))

    def send(self, unit: LaunchUnit, files: Sequence[Path], remote_dir: str) -> None:
        try:
            self.hosts.upload(unit.host, [str(f) for f in files], remote_dir.rstrip("/") + "/")
        except ColdsnapError as err:
            raise ToolError("sending the layers of unit %s to host %s failed: %s" % (unit.name, unit.host, err.message)) from err

    # -- ranks -------------------------------------------------------------------------------

    def start(self, unit: LaunchUnit, command: str, env: dict[str, str]) -> None:
        self.ranks.start(unit, command, env)

    def wait_rendezvous(self, head: LaunchUnit, port: int) -> float:
        record = next((r for r in self.ranks.started if r.unit.name == head.name), None)
        if record is None:
            raise RequestError("unit %s was not started here" % head.name)
        return wait_rendezvous(self.ranks, record, port)

    def alive(self) -> bool:
        return all(self.ranks.alive(r) for r in self.ranks.started)

    def dead_units(self) -> list[str]:
        return dead_ranks(self.ranks)

    def log_errors(self) -> list[str]:
        out = []
        for record in self.ranks.started:
            try:
                found = log_cause.causes(self.ranks.log_text(record))
            except ColdsnapError:
                continue  # a host that does not answer now: the failure itself says so
            if found:
                out.append("%s on host %s: %s" % (record.unit.name, record.unit.host, " ... ".join(found)))
        return out

    def root_pid(self, unit: LaunchUnit) -> int:
        pid = self.call(unit, RootStep(name=self.ranks.name_of(unit)), timeout=60).pid
        if not pid:
            raise ToolError("unit %s on host %s: sparkrun's record of %s names no running process" % (unit.name, unit.host, self.ranks.name_of(unit)))
        return int(pid)

    def signal_group(self, unit: LaunchUnit, pid: int, signal: str) -> None:
        self.hosts.run(unit.host, ["kill", "-%s" % signal, "--", "-%d" % pid], timeout=60)

    def adopt(self, unit: LaunchUnit, pid: int) -> None:
        name = self.ranks.name_of(unit)
        self.call(unit, AdoptStep(name=name, pid=pid), timeout=60)
        if not any(r.unit.name == unit.name for r in self.ranks.started):
            self.ranks.started.append(RankRecord(unit, name))

    def stop_all(self) -> list[str]:
        return self.ranks.stop_all()

    def stop_named(self, units: Sequence[LaunchUnit]) -> list[str]:
        running = []
        for u in units:
            for rank in self.call(u, RecordedStep(pattern=self.rank_pattern(u)), timeout=60).ranks:
                running.append("%s (%s on %s)" % (u.name, rank.name, u.host))
                self.ranks.started.append(RankRecord(u, rank.name))
        # Its connections end first, on every host: a workload restored from the same capsule
        # holds the very ones the restore brings back, and stopped the ordinary way their
        # leftovers would answer the restored ranks with resets (host/connections.py). A host
        # whose kernel cannot end them still has its ranks stopped: the restore may then lose
        # a connection, which its validation reports.
        for u in units:
            with contextlib.suppress(ColdsnapError):
                self.call(u, AbortConnectionsStep(pattern=self.rank_pattern(u)), timeout=120)
        problems = self.ranks.stop_all()
        if problems:
            raise ToolError("stopping the workload this restore replaces failed: %s" % "; ".join(problems))
        return running

    def rank_name(self, unit: LaunchUnit) -> str:
        return self.ranks.name_of(unit)

    def rank_pattern(self, unit: LaunchUnit) -> str:
        return intent_pattern(self.ranks.name_of(unit))  # the placement token is the run's own

    def head_address(self, unit: LaunchUnit) -> str:
        return unit.host
