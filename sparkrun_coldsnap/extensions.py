"""Our own extension points, loaded: bundled adapters and drivers plus any installed third-party ones."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pluggy

from sparkrun_coldsnap import hookspecs
from sparkrun_coldsnap.errors import RequestError

if TYPE_CHECKING:
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.engines.base import EngineAdapter

ENTRY_POINT_GROUP = "sparkrun_coldsnap"

BUNDLED = (
    "sparkrun_coldsnap.engines.vllm",
    "sparkrun_coldsnap.engines.sglang",
    "sparkrun_coldsnap.drivers.cpu",
    "sparkrun_coldsnap.drivers.n610",
    "sparkrun_coldsnap.drivers.n580",
)


def make_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in BUNDLED:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


@dataclass
class Extensions:
    engines: dict[str, EngineAdapter] = field(default_factory=dict)
    drivers: dict[str, SnapshotDriver] = field(default_factory=dict)

    def engine(self, name: str) -> EngineAdapter:
        try:
            return self.engines[name]
        except KeyError:
            raise RequestError("unknown engine %r: use one of %s" % (name, ", ".join(sorted(self.engines)))) from None

    def engine_for_runtime(self, runtime: str) -> EngineAdapter:
        for adapter in self.engines.values():
            if runtime in adapter.runtimes:
                return adapter
        raise RequestError("no engine adapter serves sparkrun runtime %r: set coldsnap.engine to one of %s" % (runtime, ", ".join(sorted(self.engines))))

    def driver(self, name: str) -> SnapshotDriver:
        try:
            return self.drivers[name]
        except KeyError:
            raise RequestError("unknown snapshot driver %r: use auto or one of %s" % (name, ", ".join(sorted(self.drivers)))) from None

    def drivers_by_preference(self) -> list[SnapshotDriver]:
        return sorted(self.drivers.values(), key=lambda d: d.preference)


def collect(pm: pluggy.PluginManager) -> Extensions:
    reg = Extensions()

    def add(table: dict, kind: str, item) -> None:
        if item.name in table:
            raise RequestError("two %s plugins claim the name %r: uninstall one of them" % (kind, item.name))
        table[item.name] = item

    pm.hook.register_engines(register=lambda a: add(reg.engines, "engine", a))
    pm.hook.register_drivers(register=lambda d: add(reg.drivers, "driver", d))
    return reg


@functools.lru_cache(maxsize=1)
def registry() -> Extensions:
    return collect(make_manager())
