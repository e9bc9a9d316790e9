"""FAKE hosts of a multi-unit workload, speaking the real wire: a test double of ``UnitHosts``.

Every step crosses the same wire a real host's does: the request framed by the coordinator's
end (``units/remote.py``), read and validated into its step model by the agent's own
``handle`` (``units/agent.py``), carried out by a host object (``LocalHost`` or a FAKE that
overrides some of its steps), answered in a frame and validated again at the coordinator's
end. A test changes what a host does by overriding ``host`` (which object carries the step
out) or ``host_end`` (what comes back: an error frame, nothing at all). mypy checks this
module against ``UnitHosts`` (``pyproject.toml``), so the double cannot drift from the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.launch.remote import Tick, UnitHosts
from sparkrun_coldsnap.units import agent, framing, remote
from sparkrun_coldsnap.units.local import LocalHost
from sparkrun_coldsnap.units.step import Answer, Step


class NoRecords:
    """A host where the workload manager recorded no rank."""

    def pid(self, name: str) -> int | None:
        return None

    def log_path(self, name: str) -> Path:
        return Path("/dev/null")

    def named(self, pattern: str) -> list[tuple[str, int]]:
        return []

    def register(self, name: str, pid: int) -> Path:
        raise AssertionError("a FAKE host records no rank (%s, pid %d)" % (name, pid))


class FakeUnitHosts:
    """``UnitHosts`` whose steps cross the real wire to FAKE hosts; every step and signal is
    logged as (step or signal, host), in one order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    # -- the wire -------------------------------------------------------------------------------

    def call[A: Answer](self, unit: LaunchUnit, step: Step[A], *, timeout: float = 900.0) -> A:
        self.log.append((step.verb, unit.host))
        returncode, out = self.host_end(unit, remote.request(step))
        return remote.answer(step, out, unit=unit.name, host=unit.host, returncode=returncode, tail="")

    def host_end(self, unit: LaunchUnit, request: bytes) -> tuple[int, bytes]:
        """What the unit's host writes back to *request*: (exit status, standard output)."""
        frame, ok = agent.handle(request, self.host(unit))
        return (0 if ok else 1), frame

    def host(self, unit: LaunchUnit) -> LocalHost:
        """What carries out the unit's steps on its host (default: this machine, no ranks recorded)."""
        return LocalHost(NoRecords())

    @staticmethod
    def error(code: str, message: str) -> tuple[int, bytes]:
        """A host's answer that is an error frame."""
        return 1, framing.error(code, message)

    # -- ranks and signals -----------------------------------------------------------------------

    def signal_group(self, unit: LaunchUnit, pid: int, signal: str) -> None:
        self.log.append((signal, unit.host))

    def adopt(self, unit: LaunchUnit, pid: int) -> None:
        self.log.append(("adopt", unit.host))

    def rank_name(self, unit: LaunchUnit) -> str:
        return "cluster_node_%d" % unit.rank

    def rank_pattern(self, unit: LaunchUnit) -> str:
        return "cluster_*_node_%d" % unit.rank

    def head_address(self, unit: LaunchUnit) -> str:
        return unit.host

    def root_pid(self, unit: LaunchUnit) -> int:
        raise AssertionError("FAKE hosts start no ranks: name the root of %s in the test" % unit.name)

    # -- what FAKE hosts do not do -------------------------------------------------------------------

    def check_reachable(self, units: Sequence[LaunchUnit]) -> None:
        pass

    def listening(self, unit: LaunchUnit, port: int) -> bool:
        return False

    def start(self, unit: LaunchUnit, command: str, env: dict[str, str]) -> None:
        raise AssertionError("FAKE hosts start no engine (%s)" % unit.name)

    def wait_rendezvous(self, head: LaunchUnit, port: int) -> float:
        raise AssertionError("FAKE hosts start no engine (%s)" % head.name)

    def alive(self) -> bool:
        return True

    def dead_units(self) -> list[str]:
        return []

    def log_errors(self) -> list[str]:
        return []  # FAKE hosts run no engine: no log states an error

    def fetch(self, unit: LaunchUnit, remote: str, local: Path, *, digest: str, size: int, tick: Tick | None = None) -> None:
        raise AssertionError("FAKE hosts hold no files (%s of %s)" % (remote, unit.name))

    def send(self, unit: LaunchUnit, files: Sequence[Path], remote_dir: str) -> None:
        raise AssertionError("FAKE hosts hold no files (%s)" % unit.name)

    def stop_all(self) -> list[str]:
        return []

    def stop_named(self, units: Sequence[LaunchUnit]) -> list[str]:
        return []


def _checked(hosts: FakeUnitHosts) -> UnitHosts:
    return hosts  # mypy: the double has every method of the protocol, with its signature
