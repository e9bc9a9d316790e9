"""Threads that run a caller's work in a copy of the caller's context.

The plugin's settings live in a context variable (``documents/settings.py``): an operation
runs under its own, and two operations of one process, each on a thread of its own, read
their own. A thread Python starts begins with an empty context, so work handed to a pool
or a thread would read the process's settings instead of its caller's: every pool and
thread of the plugin comes from here, and each call it runs sees what its caller saw.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose every call runs in a copy of the context of the thread that submitted it
    (``map`` submits each call, so it does too)."""

    def submit[**P, T](self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        # One copy per call: a context can be entered by one thread at a time.
        context = contextvars.copy_context()
        return super().submit(lambda: context.run(fn, *args, **kwargs))


def start_thread(target: Callable[..., object], *args: object, name: str, daemon: bool = False) -> threading.Thread:
    """*target* started on a thread of its own, in a copy of this thread's context."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target, *args), name=name, daemon=daemon)
    thread.start()
    return thread
