"""What the controller needs of the hosts of a workload placed as several launch units.

A unit of a multi-host workload runs on its own host: it is started there by the manager's
own launch (for sparkrun, its executor's node script), and everything that reads or writes
its process tree (CRIU, ``/proc``, the images, the rank's records) runs there too, through
the manager's transport. The controller tells the multi-unit stories against this
interface; :mod:`sparkrun_coldsnap.integration.unit_hosts` implements it with sparkrun's
transport and executor. Each step on a unit's host is a typed request of
:mod:`sparkrun_coldsnap.units.steps` answered by that host's agent (``units/agent.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import LaunchUnit
    from sparkrun_coldsnap.units.step import Answer, Step

Tick = Callable[[int], None]


class UnitHosts(Protocol):
    """The hosts of one multi-unit workload, as the controller sees them."""

    def check_reachable(self, units: Sequence[LaunchUnit]) -> None:
        """Raise, naming the first host that does not answer and its unit, before anything starts."""
        ...

    def listening(self, unit: LaunchUnit, port: int) -> bool:
        """Whether something on the unit's host listens on *port*."""
        ...

    def start(self, unit: LaunchUnit, command: str, env: dict[str, str]) -> None:
        """Start the unit's engine on its host under the manager's name for it."""
        ...

    def wait_rendezvous(self, head: LaunchUnit, port: int) -> float:
        """Wait for the head unit to listen on the ranks' rendezvous port; seconds waited."""
        ...

    def alive(self) -> bool:
        """Whether every unit started or restored here still runs."""
        ...

    def dead_units(self) -> list[str]:
        """The units that exited, each named with its host and what its log says of why."""
        ...

    def log_errors(self) -> list[str]:
        """The errors the log of each unit started or restored here states (its first and
        last), each named with its unit and host; none where a log states none."""
        ...

    def root_pid(self, unit: LaunchUnit) -> int:
        """The root of the unit's process tree on its host (it leads its process group)."""
        ...

    def signal_group(self, unit: LaunchUnit, pid: int, signal: str) -> None:
        """Send *signal* (STOP, CONT, KILL) to the process group *pid* leads on the unit's host."""
        ...

    def call[A: Answer](self, unit: LaunchUnit, step: Step[A], *, timeout: float = 900.0) -> A:
        """Run *step* on the unit's host; its answer, validated. A failure is one ToolError
        naming the unit, the host and the step, with the host's error code (``host.bad_answer``
        when no well-formed answer came back)."""
        ...

    def fetch(self, unit: LaunchUnit, remote: str, local: Path, *, digest: str, size: int, tick: Tick | None = None) -> None:
        """Copy file *remote* of the unit's host to *local*, checked against *digest*."""
        ...

    def send(self, unit: LaunchUnit, files: Sequence[Path], remote_dir: str) -> None:
        """Copy local *files* into directory *remote_dir* of the unit's host."""
        ...

    def adopt(self, unit: LaunchUnit, pid: int) -> None:
        """Record *pid* (a restored tree's root) as the unit's workload: the manager sees it."""
        ...

    def stop_all(self) -> list[str]:
        """Stop every unit started, restored or adopted here; the problems, one per unit."""
        ...

    def stop_named(self, units: Sequence[LaunchUnit]) -> list[str]:
        """Stop whatever runs on the units' hosts under the units' names (the workload a
        restore replaces); the units that were running."""
        ...

    def rank_name(self, unit: LaunchUnit) -> str:
        """The name the manager tracks the unit's workload by on its host."""
        ...

    def rank_pattern(self, unit: LaunchUnit) -> str:
        """A glob matching the names the manager gives this rank in any run of the same recipe."""
        ...

    def head_address(self, unit: LaunchUnit) -> str:
        """The address rank 0's endpoint answers at, seen from here."""
        ...
