"""Copy bytes while leaving holes where the data is zero.

Shared-memory ring buffers of inference engines are hundreds of MB of mostly
zeros, and so are parts of process images; writing those zeros would cost
memory on tmpfs and time on disk.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import BinaryIO

BLOCK = 1 << 20
_ZERO = bytes(BLOCK)


def write_sparse(src: BinaryIO, dst: BinaryIO, size: int | None = None) -> int:
    """Copy *src* (up to *size* bytes) into *dst*, seeking over all-zero blocks."""
    copied = 0
    while size is None or copied < size:
        want = BLOCK if size is None else min(BLOCK, size - copied)
        chunk = src.read(want)
        if not chunk:
            break
        if chunk == _ZERO[: len(chunk)]:
            dst.seek(len(chunk), os.SEEK_CUR)
        else:
            dst.write(chunk)
        copied += len(chunk)
    # A trailing hole needs the length set explicitly.
    dst.truncate(dst.tell())
    return copied


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_sparse_parallel(src: BinaryIO, fd: int, size: int, writers: Executor, *, ahead: int = 16) -> int:
    """Copy *size* bytes of *src* into the file open at *fd* as write_sparse does, the writes
    of its non-zero blocks done by *writers* (at most *ahead* blocks waiting): writing into
    tmpfs or the page cache is page allocation and a memory copy, which several cores do
    faster than one, while *src* is read on this thread."""
    os.ftruncate(fd, size)  # the length first: blocks left unwritten are holes
    pending: deque[Future[None]] = deque()
    copied = 0
    try:
        while copied < size:
            chunk = src.read(min(BLOCK, size - copied))
            if not chunk:
                break
            if chunk != _ZERO[: len(chunk)]:
                pending.append(writers.submit(_pwrite_all, fd, chunk, copied))
            copied += len(chunk)
            while len(pending) > ahead:
                pending.popleft().result()
    finally:
        for f in pending:  # every write done (or failed) before the caller closes the file
            f.exception()
    for f in pending:
        f.result()
    if copied < size:
        os.ftruncate(fd, copied)
    return copied


def copy_sparse(src: Path, dst: Path, mode: int | None = None) -> int:
    """Copy file *src* to *dst* (replacing it atomically), keeping zero regions as holes."""
    dst = Path(dst)
    tmp = dst.with_name(".%s.coldsnap-tmp" % dst.name)
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        n = write_sparse(fi, fo)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, dst)
    return n
