"""The stories: capture, prepare and activate a restore, start vanilla.

Each story is written once, over the units it runs on: one unit on this host (``*_here``)
or every unit on its host (``*_hosts``). Each runs named, timed phases into a receipt,
stages its work privately and publishes last, and on failure cleans up (stops what it
started, drops what it staged) without hiding the first error. They are written against
interfaces: an engine adapter, a snapshot driver, a launcher, the hosts' typed steps.
"""

from sparkrun_coldsnap.controller.admit import unpinned_vanilla
from sparkrun_coldsnap.controller.capture import CaptureOutcome, CaptureUnits, LiveWorkload, capture
from sparkrun_coldsnap.controller.capture_here import HereCapture
from sparkrun_coldsnap.controller.capture_hosts import HostsCapture
from sparkrun_coldsnap.controller.common import Attempt, ServingOutcome, finish, require_one_unit
from sparkrun_coldsnap.controller.cut import UnitOnHost
from sparkrun_coldsnap.controller.ranks import ordered, start_units
from sparkrun_coldsnap.controller.restore import PreparedRestore, RestoreUnits, activate, prepare
from sparkrun_coldsnap.controller.restore_here import HereRestore, check_admission, open_and_admit, unpack_capsule, unpacked_size
from sparkrun_coldsnap.controller.restore_hosts import HostsRestore, refuse_topology
from sparkrun_coldsnap.controller.vanilla import start_vanilla
from sparkrun_coldsnap.units.resolved import Resolved, resolve

__all__ = [
    "Attempt",
    "CaptureOutcome",
    "CaptureUnits",
    "HereCapture",
    "HereRestore",
    "HostsCapture",
    "HostsRestore",
    "LiveWorkload",
    "PreparedRestore",
    "Resolved",
    "RestoreUnits",
    "ServingOutcome",
    "UnitOnHost",
    "activate",
    "capture",
    "check_admission",
    "finish",
    "open_and_admit",
    "ordered",
    "prepare",
    "refuse_topology",
    "require_one_unit",
    "resolve",
    "start_units",
    "start_vanilla",
    "unpack_capsule",
    "unpacked_size",
    "unpinned_vanilla",
]
