"""One call run on a thread of its own, with a future to wait on: preparation's reads that
go on beside each other (the tree's files, the payload's copy into memory)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


def in_background[T](fn: Callable[..., T], *args: object, **kwargs: object) -> Future[T]:
    """*fn* run once on a thread of its own; its future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="coldsnap-preparation")
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)
