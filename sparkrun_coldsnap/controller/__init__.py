"""The stories: capture, prepare and activate a restore, start vanilla.

Each operation runs named, timed phases into a receipt, stages its work
privately and publishes last, and on failure cleans up (stops what it
started, drops what it staged) without hiding the first error. They are
written against interfaces: an engine adapter, a snapshot driver, a launcher.
"""

from sparkrun_coldsnap.controller.capture import CaptureOutcome, LiveWorkload, capture
from sparkrun_coldsnap.controller.common import ServingOutcome, require_one_unit
from sparkrun_coldsnap.controller.restore import PreparedRestore, activate_restore, check_admission, prepare_restore
from sparkrun_coldsnap.controller.vanilla import start_vanilla
from sparkrun_coldsnap.units.resolved import Resolved, resolve

__all__ = [
    "CaptureOutcome",
    "LiveWorkload",
    "PreparedRestore",
    "Resolved",
    "ServingOutcome",
    "activate_restore",
    "capture",
    "check_admission",
    "prepare_restore",
    "require_one_unit",
    "resolve",
    "start_vanilla",
]
