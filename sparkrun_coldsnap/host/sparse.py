"""Copy bytes while leaving holes where the data is zero.

Shared-memory ring buffers of inference engines are hundreds of MB of mostly
zeros, and so are parts of process images; writing those zeros would cost
memory on tmpfs and time on disk.
"""

from __future__ import annotations

import os
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
