"""Messages between the coordinator and a unit's host: newline-framed JSON with a size cap.

A frame is one line: the marker ``coldsnap-frame/1``, a space, one JSON object, a newline.
The marker keeps a step's stray output (a tool's banner, a warning printed by a library)
from being read as a message: only marked lines are frames, and a message is exactly one
frame. Three kinds:

- a request: ``{"step": VERB, "request": {...}}``;
- an answer: ``{"answer": {...}}``;
- an error: ``{"error": {"code": CODE, "message": ONE LINE}}``, the code a stable one
  (``errors.py``) that reaches the receipt.

A frame over the cap, one that is not a JSON object of one of these shapes, several frames
or none are a :class:`FrameError` (``host.bad_frame``); the ends name the unit, the host and
the step when they report it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap.documents.strict import one_line
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.units.step import Answer, Step

MARK = b"coldsnap-frame/1 "
#: bytes one frame may hold: a capsule's config (admission's request) is the largest message,
#: a few MB for a workload with thousands of mapped files
MAX_BYTES = 64 << 20


class FrameError(ColdsnapError):
    """A message that is not one well-formed frame of the expected kind."""

    code = "host.bad_frame"


class NoFrame(FrameError):
    """Nothing framed came back (the program did not run, or died before it answered)."""


class StepFailed(ColdsnapError):
    """The host answered with an error frame: its code and message."""

    code = "host.step_failed"


def encode(doc: Mapping[str, Any], *, limit: int = MAX_BYTES) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    if len(body) > limit:
        raise FrameError("a message of %d bytes is over the frame cap of %d bytes" % (len(body), limit))
    return MARK + body + b"\n"


def decode(data: bytes | str, *, limit: int = MAX_BYTES) -> dict[str, Any]:
    """The one frame in *data*, whatever unmarked lines surround it."""
    raw = data.encode(errors="replace") if isinstance(data, str) else data
    frames = [line[len(MARK) :] for line in raw.split(b"\n") if line.startswith(MARK)]
    if not frames:
        raise NoFrame("no frame")
    if len(frames) > 1:
        raise FrameError("%d frames where one was expected" % len(frames))
    if len(frames[0]) > limit:
        raise FrameError("a frame of %d bytes is over the cap of %d bytes" % (len(frames[0]), limit))
    try:
        doc = json.loads(frames[0])
    except ValueError as err:
        raise FrameError("a frame that is not JSON (%s)" % err) from None
    if not isinstance(doc, dict):
        raise FrameError("a frame that is not a JSON object")
    return doc


# -- the request ---------------------------------------------------------------------------------


def request(step: Step[Any]) -> bytes:
    return encode({"step": step.verb, "request": step.model_dump(mode="json")})


def read_request(data: bytes | str, steps: Mapping[str, type[Step[Any]]], *, limit: int = MAX_BYTES) -> Step[Any]:
    """The step *data* asks for, validated into its model."""
    doc = decode(data, limit=limit)
    if set(doc) != {"step", "request"} or not isinstance(doc["request"], dict):
        raise FrameError("a request frame holds exactly step and request (an object), not %s" % ", ".join(sorted(doc)))
    model = steps.get(str(doc["step"]))
    if model is None:
        raise FrameError("unknown step %r: name one of %s" % (doc["step"], ", ".join(sorted(steps))))
    try:
        return model.model_validate(doc["request"])
    except PydanticValidationError as err:
        raise FrameError(one_line(err, prefix="step %s: the request" % model.verb)) from None


# -- the answer -------------------------------------------------------------------------------------


def answer(ans: Answer) -> bytes:
    return encode({"answer": ans.model_dump(mode="json")})


def error(code: str, message: str) -> bytes:
    # One line, as every error of the project is; the frame must not be cut by it either.
    return encode({"error": {"code": code, "message": " ".join(message.split())}})


def read_answer[A: Answer](step: Step[A], data: bytes | str, *, limit: int = MAX_BYTES) -> A:
    """*step*'s answer in *data*; :class:`StepFailed` for an error frame."""
    doc = decode(data, limit=limit)
    if set(doc) == {"error"}:
        err = doc["error"]
        if not isinstance(err, dict) or not isinstance(err.get("code"), str) or not isinstance(err.get("message"), str):
            raise FrameError("an error frame without a code and a message")
        raise StepFailed(err["message"], code=err["code"])
    if set(doc) != {"answer"}:
        raise FrameError("an answer frame holds exactly answer or error, not %s" % ", ".join(sorted(doc)))
    try:
        return step.read_answer(doc["answer"])
    except PydanticValidationError as err:
        raise FrameError(one_line(err, prefix="the answer")) from None
