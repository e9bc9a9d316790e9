"""What the bundled drivers share: CRIU captures their process trees."""

from __future__ import annotations

from sparkrun_coldsnap.drivers.base import SnapshotDriver
from sparkrun_coldsnap.drivers.criu_tool import Criu


class CriuDriver(SnapshotDriver):
    """A driver whose images CRIU writes and reads: the CRIU version is part of the fingerprint."""

    def checkpoint_tool_version(self) -> str | None:
        return Criu.locate().version
