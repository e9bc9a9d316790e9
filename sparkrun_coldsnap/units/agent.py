"""The host end of the steps: one framed request in, one framed answer out.

The coordinator runs this on the unit's host through the manager's transport (for sparkrun:
``python -m sparkrun_coldsnap.integration.unit_agent``, which hands in how sparkrun records
its ranks), writes one request frame to its standard input and reads one frame from its
standard output (:mod:`sparkrun_coldsnap.units.framing`). The request is validated into its
step's model, the step runs on :class:`~sparkrun_coldsnap.units.local.LocalHost`, and the
answer (or an error frame with the error's code, exit status 1) is the only frame written.

While the step runs, whatever it or the programs it starts write to standard output goes to
standard error instead: the answer's descriptor is kept apart, so no stray line can be taken
for the answer or cut into it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import BinaryIO

from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.units import framing
from sparkrun_coldsnap.units.local import LocalHost, RankRecords
from sparkrun_coldsnap.units.steps import STEPS


def handle(request: bytes, host: LocalHost) -> tuple[bytes, bool]:
    """The answer frame to *request*, and whether the step succeeded."""
    try:
        step = framing.read_request(request, STEPS)
    except framing.FrameError as err:
        return framing.error("host.bad_request", err.message), False
    try:
        return framing.answer(host.run(step)), True
    except ColdsnapError as err:
        return framing.error(err.code, err.message), False
    except Exception as err:  # noqa: BLE001 - the coordinator reports it, naming the host and the step
        return framing.error("host.unexpected", "step %s: %s: %s" % (step.verb, type(err).__name__, err)), False


@contextlib.contextmanager
def _answer_channel() -> Iterator[BinaryIO]:
    """Standard output kept for the answer; fd 1 points at standard error meanwhile."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(kept, "wb", closefd=False) as out:
            yield out
    finally:
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


def serve(records: RankRecords, stdin: BinaryIO | None = None) -> int:
    """Answer the one request on standard input; the exit status."""
    source = stdin or sys.stdin.buffer
    # One byte over the cap is enough to know a frame is too large.
    request = source.read(framing.MAX_BYTES + len(framing.MARK) + 2)
    with _answer_channel() as out:
        frame, ok = handle(request, LocalHost(records))
        out.write(frame)
        out.flush()
    return 0 if ok else 1
