"""How far a copy into memory has come, for a reader that follows it.

On a node with nothing prepared the native payload is still being copied into memory when
the restored engine is ready to hydrate. Instead of waiting for the last byte, the engine
copies each tensor to the GPU as soon as its bytes are in place. The writer says how far it
has come through one mark per file, ``.filling/<name>`` beside it: an empty file whose size
is the number of bytes in place from the file's start. A size is changed atomically (a
reader never sees half of an update), costs no data, and needs no lock shared between the
two processes. A mark that is gone means the copy was given up.

The engine's side reads these marks in ``engine_side/coldsnap_native_weights.py`` (its own
interpreter cannot import this module): ``FILLING`` is the same name there.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

FILLING = ".filling"


class FillMark:
    """The mark of one file being filled from its start; pieces may finish in any order."""

    def __init__(self, directory: Path, name: str) -> None:
        marks = directory / FILLING
        marks.mkdir(mode=0o700, exist_ok=True)
        self.path = marks / name
        self.path.write_bytes(b"")
        self._lock = threading.Lock()
        self._prefix = 0
        self._done: dict[int, int] = {}  # pieces finished past the prefix: start -> end

    @property
    def filled(self) -> int:
        return self._prefix

    def done(self, start: int, length: int) -> None:
        """Bytes [start, start + length) are in place; the mark moves to the end of what is
        in place without a gap from the file's start."""
        with self._lock:
            self._done[start] = start + length
            moved = self._prefix
            while moved in self._done:
                moved = self._done.pop(moved)
            if moved != self._prefix:
                self._prefix = moved
                os.truncate(self.path, moved)

    def give_up(self) -> None:
        """The copy will not finish: a reader following it stops instead of waiting."""
        self.path.unlink(missing_ok=True)
