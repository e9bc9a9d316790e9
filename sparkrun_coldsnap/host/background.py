"""One call run on a thread of its own, with a future to wait on: preparation's reads that
go on beside each other (the tree's files, the payload's copy into memory)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from sparkrun_coldsnap.host.threads import ContextPool


def in_background[T](fn: Callable[..., T], *args: object, **kwargs: object) -> Future[T]:
    """*fn* run once on a thread of its own; its future."""
    pool = ContextPool(1, thread_name_prefix="coldsnap-preparation")
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)


class Milestone:
    """A point partway through a piece of background work that other work may wait for
    (``future``): reached when the work calls ``reach``, or when it ends however it ends,
    so that no waiter is left behind by a step the work skipped or failed before."""

    def __init__(self) -> None:
        self.future: Future[None] = Future()

    def reach(self) -> None:
        with contextlib.suppress(InvalidStateError):
            self.future.set_result(None)

    def by_end_of(self, work: Future[Any]) -> None:
        work.add_done_callback(lambda _: self.reach())
