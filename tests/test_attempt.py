"""One failure context for every operation, one unit or several: what it stops, in which order it
cleans up, and that the first error is the one raised, with its receipt."""

from __future__ import annotations

import pytest

from sparkrun_coldsnap.controller.common import Attempt
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.errors import CaptureError, ToolError


def test_units_on_their_hosts_are_stopped_then_cleanups_run_last_first_and_the_message_says_so():
    done: list[str] = []

    def stop_all() -> list[str]:
        done.append("stop")
        return ["unit b on host h2: did not answer"]

    rb = ReceiptBuilder("capture")
    with pytest.raises(CaptureError) as caught, Attempt(rb, stop=stop_all, told="every unit started has been stopped") as attempt:
        attempt.on_failure(lambda: done.append("first registered"))
        attempt.on_failure(lambda: done.append("last registered"))
        raise CaptureError("the dump failed")
    assert done == ["stop", "last registered", "first registered"]
    assert caught.value.message == "the dump failed; every unit started has been stopped (unit b on host h2: did not answer)"
    assert caught.value.receipt is not None and caught.value.receipt.state == "failed"


def test_a_cleanup_that_fails_is_reported_beside_the_first_error_and_the_others_still_run():
    done: list[str] = []

    def failing() -> None:
        raise ToolError("removing /staging failed")

    rb = ReceiptBuilder("restore")
    with pytest.raises(CaptureError) as caught, Attempt(rb) as attempt:
        attempt.on_failure(lambda: done.append("ran"))
        attempt.on_failure(failing)
        raise CaptureError("admission refused")
    assert done == ["ran"]
    assert caught.value.message.startswith("admission refused") and "removing /staging failed" in caught.value.message
    assert caught.value.receipt is not None


def test_nothing_is_stopped_or_cleaned_when_the_operation_succeeds():
    done: list[str] = []
    with Attempt(ReceiptBuilder("capture"), stop=lambda: done.append("stop") or []) as attempt:
        attempt.on_failure(lambda: done.append("cleanup"))
    assert done == []
