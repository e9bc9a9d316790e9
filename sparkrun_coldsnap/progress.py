"""Progress for long work: a live line on a terminal, plain lines otherwise.

Everything goes to stderr so ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, SpinnerColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress

#: one line of progress a tool reports as it goes (the drivers and CRIU take one)
Report = Callable[[str], None]


def _ignore(seconds: float, detail: str = "") -> None:
    """The quiet progress callback."""


class Progress:
    def __init__(self, *, quiet: bool = False, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.live = (not quiet) and self.stream.isatty()
        self.console = Console(file=self.stream, highlight=False)

    def step(self, text: str) -> None:
        if not self.quiet:
            self.console.print("[bold]==>[/bold] " + text) if self.live else print("==> " + text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if not self.quiet:
            print("    " + text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def waiting(self, text: str, *, every: float = 10.0) -> Iterator[Callable[[float, str], None]]:
        """A spinner with elapsed time; the callback takes (seconds, detail)."""
        if self.quiet:
            yield _ignore
            return
        if self.live:
            with RichProgress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console, transient=False) as bar:
                task = bar.add_task(text)

                def tick(_seconds: float, detail: str = "") -> None:
                    bar.update(task, description="%s %s" % (text, ("[dim]" + detail[:80] + "[/dim]") if detail else ""))

                yield tick
                bar.update(task, description=text + " done")
            return
        print("==> %s" % text, file=self.stream, flush=True)
        last = [time.monotonic()]

        def tick_plain(seconds: float, detail: str = "") -> None:
            if time.monotonic() - last[0] >= every:
                last[0] = time.monotonic()
                print("    ... %.0f s%s" % (seconds, (": " + detail[:100]) if detail else ""), file=self.stream, flush=True)

        yield tick_plain

    @contextlib.contextmanager
    def transfer(self, text: str, total: int) -> Iterator[Callable[[int], None]]:
        """A byte counter; the callback takes a number of bytes just moved."""
        if self.quiet:
            yield lambda _n: None
            return
        if self.live:
            with RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=self.console) as bar:
                task = bar.add_task(text, total=total or None)
                yield lambda n: bar.advance(task, n)
            return
        print("==> %s (%.1f MB)" % (text, total / 1e6), file=self.stream, flush=True)
        done = [0, time.monotonic()]

        def tick(n: int) -> None:
            done[0] += n
            if time.monotonic() - done[1] >= 10:
                done[1] = time.monotonic()
                print("    ... %.0f%%" % (100.0 * done[0] / total if total else 0), file=self.stream, flush=True)

        yield tick


QUIET = Progress(quiet=True)
