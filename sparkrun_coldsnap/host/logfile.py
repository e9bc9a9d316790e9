"""Reading the end of an engine's log."""

from __future__ import annotations

import os
from pathlib import Path


def last_line(path: Path, window: int = 4096) -> str:
    """The last non-empty line of a log file (read from its end), or "" when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - window, 0))
            lines = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""
