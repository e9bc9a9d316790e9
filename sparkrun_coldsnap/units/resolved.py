"""A workload's names resolved on the host it runs on: its engine adapter, snapshot driver,
launcher and engine environment, with what that environment says of the engine's versions.

The controller resolves a workload where an operation starts; a unit's host resolves it again
where its steps run (``units/local.py``), each with its own registry of drivers and engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.documents.request import Workload
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.drivers.base import SnapshotDriver
from sparkrun_coldsnap.engines.base import EngineAdapter
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.launch.base import Launcher
from sparkrun_coldsnap.launch.engine_env import EngineEnv, EngineFacts, command_facts, image_facts
from sparkrun_coldsnap.launch.units import launcher_for

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.fingerprint import Fingerprint


@dataclass(frozen=True)
class Resolved:
    """A workload's names resolved on this host: its engine adapter, driver, launcher and engine."""

    adapter: EngineAdapter
    driver: SnapshotDriver
    launcher: Launcher
    engine_env: EngineEnv | None
    facts: EngineFacts | None

    def fingerprint(self, workload: Workload, tool_version: str | None) -> Fingerprint:
        from sparkrun_coldsnap.compat.admission import fingerprint

        return fingerprint(workload, self.adapter, self.driver, self.facts, tool_version=tool_version, container_runtime=self.launcher.runtime_summary())


def resolve(workload: Workload, settings: Settings) -> Resolved:
    reg = extensions.registry()
    adapter = reg.engine(workload.engine)
    driver = reg.driver(workload.driver)
    problem = driver.engine_problem(adapter)
    if problem:
        raise RequestError(problem)
    launcher = launcher_for(workload.launch.executor)
    engine_env = EngineEnv.named(workload.launch.engine_env) if workload.launch.engine_env else None
    facts: EngineFacts | None
    if engine_env is not None:
        facts = engine_env.facts()
    elif workload.launch.executor == "local":
        facts = command_facts(workload.launch.command, {"PATH": settings.environ.get("PATH", ""), **workload.launch.env})
    elif workload.launch.image:
        # A container: the image digest pins what is inside; its versions are read there for people.
        facts = image_facts(workload.launch.image, workload.launch.command)
    else:
        facts = None
    return Resolved(adapter, driver, launcher, engine_env, facts)
