"""What every operation of the controller shares: failure receipts, readiness and validation of
a running engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sparkrun_coldsnap import secrets
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import CaptureRequest, RestoreRequest, Workload
from sparkrun_coldsnap.documents.tokens import TokenRecord
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, RequestError, describe_cleanup_failure
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.units.resolved import Resolved


def require_one_unit(workload: Workload, operation: Literal["capture", "restore"]) -> None:
    """Refuse, in one line, a workload placed as several launch units (one per host)."""
    units = workload.topology.units
    if len(units) != 1:
        placed = ", ".join("%s on %s" % (u.name, u.host) for u in units)
        raise RequestError(
            "a request document of several launch units cannot be run as it is: the recipe places %d (%s), whose hosts are reached through sparkrun; "
            "%s the recipe through sparkrun (sparkrun coldsnap capture RECIPE --cluster NAME, then sparkrun run RECIPE), or send each unit's request to its host (--unit)" % (len(units), placed, operation),
            code="request.multi_host",
        )


@dataclass
class ServingOutcome:
    """A workload that was started or restored, validated and left serving."""

    receipt: Receipt
    root_pid: int
    ttft_seconds: float | None
    unit: RunningUnit


def finish(rb: ReceiptBuilder, err: BaseException | None) -> Receipt:
    if err is None:
        return rb.finish("succeeded")
    return rb.finish("refused" if isinstance(err, CompatibilityError) else "failed", err)


class Attempt:
    """One operation's failure handling, in one place, for one unit or several.

    On any failure it stops what the operation started: the one local unit (``running``), or
    every unit on its host (*stop*, which returns its problems, one per unit, and *told*, what
    the message adds once they are stopped); then it runs the registered cleanups, last
    registered first; and it gives a :class:`ColdsnapError` its failed (or refused) receipt.
    The error itself propagates unchanged, a stop or cleanup failure reported beside it.
    """

    def __init__(self, rb: ReceiptBuilder, *, stop: Callable[[], list[str]] | None = None, told: str | Callable[[], str] = "") -> None:
        self.rb = rb
        self.running: RunningUnit | None = None
        self._stop = stop
        self._told = told
        self._cleanups: list[Callable[[], object]] = []

    def on_failure(self, cleanup: Callable[[], object]) -> None:
        self._cleanups.append(cleanup)

    def stops(self, stop: Callable[[], list[str]], *, told: str | Callable[[], str]) -> None:
        """From here a failure stops the units with *stop* (which the operation learned of once
        it knew where its units run) and the message adds *told* (a callable: asked once the
        units are stopped, so that it may say what *stop* found)."""
        self._stop, self._told = stop, told

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> Literal[False]:
        if err is None:
            return False
        if self.running is not None:
            self._stop_running(err, self.running)
        problems = self._stop() if self._stop is not None else []
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except ColdsnapError as cleanup_err:  # reported beside the first error
                problems.append(cleanup_err.message)
        if isinstance(err, ColdsnapError):
            told = self._told() if callable(self._told) else self._told
            if told:
                err.args = (err.with_tree_stopped("%s%s" % (told, " (%s)" % "; ".join(problems) if problems else "")),)
            elif problems:
                err.args = (describe_cleanup_failure(err, ColdsnapError("; ".join(problems))),)
            if self.rb.secrets:  # the message is printed and logged too
                err.args = (secrets.scrub(err.message, self.rb.secrets),)
            err.receipt = finish(self.rb, err)
        return False

    def _stop_running(self, err: BaseException, running: RunningUnit) -> None:
        try:
            running.stop(grace=5.0)
            running.reap()
            # Say where things stand now: whatever the failure said of the tree at the
            # time, the engine this operation started is no longer running.
            self.rb.details["workload_state"] = "stopped"
            if isinstance(err, ColdsnapError):
                err.args = (err.with_tree_stopped("the engine this %s started has been stopped" % self.rb.operation),)
        except Exception as stop_failed:  # noqa: BLE001 - reported beside the first error
            self.rb.details["workload_state"] = "unknown"
            err.args = (describe_cleanup_failure(err, stop_failed),)


def validate(r: Resolved, endpoint: Endpoint, req: CaptureRequest | RestoreRequest, t0: float, expected: str | None) -> Validation:
    """One streamed chat completion; the first token is timed from *t0*; its tokens recorded when the engine returned them.

    A capture asks once more and keeps that request's time to its first token: the engine a
    restore brings back has answered this prompt already, so its validation request costs what
    a second one costs here, not the first one's warm-up (bench's floor to first token)."""
    v = req.validation
    reply = r.adapter.validate(endpoint, prompt=v.prompt, max_tokens=v.max_tokens, timeout=v.timeout_seconds)
    ttft = (reply.first_token_at - t0) if reply.first_token_at is not None else None
    passed = expected is None or reply.text == expected
    tokens = TokenRecord(ids=reply.token_ids, logprobs=reply.logprobs) if reply.has_tokens else None
    request_ttft = reply.request_ttft
    if isinstance(req, CaptureRequest) and passed:
        again = r.adapter.validate(endpoint, prompt=v.prompt, max_tokens=v.max_tokens, timeout=v.timeout_seconds)
        request_ttft = again.request_ttft if again.request_ttft is not None else request_ttft
    return Validation(passed=passed, ttft_seconds=ttft, request_ttft_seconds=request_ttft, reply=reply.text, expected_reply=expected, tokens=tokens)


def wait_ready(r: Resolved, endpoint: Endpoint, unit: RunningUnit, rb: ReceiptBuilder, progress: Progress, timeout: float) -> None:
    """Wait for the engine to answer; a failure names where its log is and its last line."""
    try:
        with rb.phase("ready"), progress.waiting("waiting for %s to answer on %s" % (r.adapter.name, endpoint.base_url)) as tick:
            r.adapter.wait_ready(endpoint, alive=unit.alive, timeout=timeout, on_tick=lambda s: tick(s, unit.tail()))
    except ColdsnapError as err:
        raise type(err)("%s; engine log: %s (last line: %s)" % (err, unit.log_location(), unit.tail() or "empty")) from err
