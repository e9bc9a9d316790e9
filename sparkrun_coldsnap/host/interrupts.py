"""SIGINT and SIGTERM while this process changes what the host serves.

Both signals unwind the process as Ctrl-C does (``KeyboardInterrupt``), so what an operation
started is stopped and its staging dropped on the way out, instead of SIGTERM's default of
dying on the spot. Inside :meth:`Interrupts.committed` (a replacement that has stopped, or is
about to stop, the workload it replaces and whose restore takes about a second) the first
signal is held until the section ends, so the host is left serving the new workload; a second
one abandons it (``KeyboardInterrupt`` where the process is, the caller says what was stopped).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """This process's SIGINT and SIGTERM handling while installed (main thread only: elsewhere
    Python cannot take signals, and nothing is changed)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        """*say*: how a held or abandoning signal is told, from the handler (so no buffered I/O)."""
        self._say = say
        self._previous: dict[int, Any] = {}
        self._committed: str | None = None
        self._abandoned = False
        #: the signal held during a committed section, once one came
        self.pending: int | None = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self._committed, self._abandoned, self.pending = None, False, None

    @contextlib.contextmanager
    def committed(self, what: str) -> Iterator[None]:
        """Within: the first signal is held (:attr:`pending`) and said to be, for *what* to finish."""
        self._committed, self._abandoned = what, False
        try:
            yield
        finally:
            self._committed = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._abandoned:
            return  # already unwinding: let the cleanup finish
        if self._committed is not None and self.pending is None:
            self.pending = signum
            self._say("%s received while %s: finishing it (about a second), so the host is left serving; send it again to abandon it" % (name, self._committed))
            return
        if self._committed is not None:
            self._abandoned = True
            self._say("%s received again: abandoning %s" % (name, self._committed))
        raise KeyboardInterrupt(name)


@contextlib.contextmanager
def as_interrupt() -> Iterator[None]:
    """SIGTERM, like SIGINT, raises ``KeyboardInterrupt`` while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
