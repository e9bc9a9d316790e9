"""The host end of a multi-unit capture or restore on a sparkrun cluster.

The coordinator reaches a unit's host only through sparkrun's transport; each step of
:mod:`sparkrun_coldsnap.units.steps` is one run of

    python -m sparkrun_coldsnap.integration.unit_agent   < request frame   > answer frame

on that host (:mod:`sparkrun_coldsnap.units.agent` serves it), with the ranks found where
sparkrun's local executor records them on that host (``integration/records.py``). The plugin
is installed on every host of a cluster, as sparkrun is, at the same path (the coordinator
calls its own interpreter's path there).
"""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.integration import records
from sparkrun_coldsnap.units import agent


class SparkrunRecords:
    """:class:`~sparkrun_coldsnap.units.local.RankRecords` as sparkrun's local executor keeps them."""

    def pid(self, name: str) -> int | None:
        return records.registered_pid(name)

    def log_path(self, name: str) -> Path:
        return records.local_record_paths(name)[1]

    def named(self, pattern: str) -> list[tuple[str, int]]:
        out = []
        for name in records.recorded_names(pattern):
            try:
                out.append((name, int(records.local_record_paths(name)[0].read_text().strip())))
            except (OSError, ValueError):
                continue
        return out

    def register(self, name: str, pid: int) -> Path:
        return records.register_local(name, pid)


if __name__ == "__main__":
    raise SystemExit(agent.serve(SparkrunRecords()))
