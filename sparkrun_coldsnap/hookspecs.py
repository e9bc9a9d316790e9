"""Extension points: engine adapters and snapshot drivers.

Bundled adapters and drivers implement these hooks exactly as a third-party
package would; a third party publishes a module implementing them under the
entry-point group ``sparkrun_coldsnap`` and it is loaded beside ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.engines.base import EngineAdapter

PROJECT = "sparkrun_coldsnap"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_engines(register: Callable[[EngineAdapter], None]) -> None:
    """Offer engine adapters.

    Called once, when the plugin manager is first used. ``register`` takes an
    :class:`~sparkrun_coldsnap.engines.base.EngineAdapter` instance; its
    ``name`` (e.g. ``vllm``) is what a recipe's ``coldsnap.engine`` selects, and
    its ``runtimes`` are the sparkrun runtimes it serves by default. A second
    adapter of the same name is an error. Returns nothing.
    """


@hookspec
def register_drivers(register: Callable[[SnapshotDriver], None]) -> None:
    """Offer snapshot drivers.

    Called once, when the plugin manager is first used. ``register`` takes a
    :class:`~sparkrun_coldsnap.drivers.base.SnapshotDriver` instance; its
    ``name`` (e.g. ``cpu``, ``n610``) is what a recipe's ``coldsnap.driver``
    selects. ``driver: auto`` picks the first registered driver, in
    ``preference`` order, whose ``support()`` accepts the host and engine. A
    second driver of the same name is an error. Returns nothing.
    """
