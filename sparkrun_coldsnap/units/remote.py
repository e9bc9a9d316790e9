"""The coordinator's end of a step: the request it sends, the answer it reads back.

A transport (sparkrun's host session: ``integration/unit_hosts.py``) runs the host's agent
with :func:`request` on its standard input and hands what came back to :func:`answer`, which
returns the step's answer model or raises one error naming the unit, the host and the step.
"""

from __future__ import annotations

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.units import framing
from sparkrun_coldsnap.units.step import Answer, Step


def request[A: Answer](step: Step[A]) -> bytes:
    return framing.request(step)


def answer[A: Answer](step: Step[A], out: bytes | str, *, unit: str, host: str, returncode: int = 0, tail: str = "") -> A:
    """*step*'s answer from what the agent on *host* wrote (*out*), for unit *unit*.

    An error frame is the host's own error (its code kept); no frame at all, a damaged one or
    an answer that is not the step's is ``host.bad_answer``."""
    try:
        return framing.read_answer(step, out)
    except framing.StepFailed as err:
        raise ToolError("unit %s on host %s: %s" % (unit, host, err.message), code=err.code) from None
    except framing.NoFrame:
        what = "ssh to %s failed" % host if returncode == 255 else "exit %d" % returncode
        raise ToolError("unit %s on host %s: step %s gave no answer (%s)%s" % (unit, host, step.verb, what, ": " + tail if tail else ""), code="host.bad_answer") from None
    except framing.FrameError as err:
        raise ToolError(
            "unit %s on host %s: step %s answered with %s: install the coordinator's version of the plugin on %s" % (unit, host, step.verb, err.message, host),
            code="host.bad_answer",
        ) from None
