"""Content addressing: canonical JSON and sha256 digests in OCI spelling."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, BinaryIO

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 4 << 20


def canonical_json(value: Any) -> bytes:
    """Serialize *value* so that equal documents give equal bytes.

    Sorted keys, no insignificant white space, UTF-8: the digest of a request
    must not depend on the order in which a recipe listed its keys.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        h = hashlib.file_digest(f, "sha256")
        return "sha256:" + h.hexdigest(), f.tell()


def is_digest(value: str) -> bool:
    return bool(_DIGEST_RE.match(value or ""))


def require_digest(value: str, what: str = "digest") -> str:
    """Return *value* if it is a well-formed sha256 digest, else raise ValueError."""
    if not is_digest(value):
        raise ValueError("%s %r is not a sha256 digest (expected 'sha256:' and 64 lower-case hex digits)" % (what, value))
    return value


def hex_of(digest: str) -> str:
    return require_digest(digest).split(":", 1)[1]


def short(digest: str) -> str:
    """A digest shortened for people: ``sha256:9f3a1c2b7e01``."""
    return digest[:19] if is_digest(digest) else digest


class HashingReader:
    """Wrap a binary stream and hash what is read through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        self._hash.update(data)
        self.size += len(data)
        return data

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()
