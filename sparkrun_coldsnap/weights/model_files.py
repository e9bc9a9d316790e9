"""Model files: recorded by size and sha256 at capture, verified before hydration.

Verification results are cached, keyed on (device, inode, size, mtime), so a
second restore does not re-hash gigabytes of weights that did not change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from sparkrun_coldsnap.digests import sha256_file
from sparkrun_coldsnap.documents.capsule_config import ModelFile
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.atomic import write_bytes

CACHE_NAME = "file-digests.json"


def model_files(model_dir: Path) -> list[Path]:
    root = Path(model_dir)
    if not root.is_dir():
        raise RequestError("model directory %s does not exist: download the model (or run `sparkrun coldsnap setup`) first" % root)
    # Hidden names are not the model's: a download tool's bookkeeping, a payload's packed copy.
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))


#: the files that hold a model's tensors (what a native payload holds again, as loaded)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the model's weight files (0 for a directory that is not there yet)."""
    root = Path(model_dir)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in model_files(root) if p.suffix in WEIGHT_SUFFIXES)


class DigestCache:
    """sha256 of files by (device, inode, size, mtime_ns), persisted as JSON."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path or paths.coldsnap_home() / CACHE_NAME)
        try:
            self.table: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.table = {}
        self.dirty = False

    @staticmethod
    def key(path: Path) -> str:
        st = os.stat(path)
        return "%d:%d:%d:%d" % (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def digest(self, path: Path) -> tuple[str, int]:
        k = self.key(path)
        size = os.stat(path).st_size
        if k in self.table:
            return self.table[k], size
        digest, size = sha256_file(path)
        self.table[k] = digest
        self.dirty = True
        return digest, size

    def save(self) -> None:
        if self.dirty:
            try:
                write_bytes(self.path, json.dumps(self.table).encode())
            except Exception:  # noqa: BLE001 - a cache that cannot be saved costs a re-hash, nothing more
                pass
            self.dirty = False


def record(model_dir: Path, cache: DigestCache | None = None) -> tuple[ModelFile, ...]:
    cache = cache or DigestCache()
    out = []
    for p in model_files(model_dir):
        digest, size = cache.digest(p)
        out.append(ModelFile(name=p.relative_to(model_dir).as_posix(), size=size, sha256=digest))
    cache.save()
    return tuple(out)


def verify(model_dir: Path, files: tuple[ModelFile, ...], *, cache: DigestCache | None = None, on_file: Callable[[str], None] | None = None) -> list[str]:
    """Problems with the local model files against the recorded ones (empty: all match)."""
    cache = cache or DigestCache()
    problems = []
    for f in files:
        path = Path(model_dir) / f.name
        if on_file:
            on_file(f.name)
        if not path.is_file():
            problems.append("model file %s is missing: download model revision again" % path)
            continue
        digest, size = cache.digest(path)
        if size != f.size or digest != f.sha256:
            problems.append("model file %s does not match the capsule (sha256 %s, recorded %s): restore the original file" % (path, digest[:19], f.sha256[:19]))
    cache.save()
    return problems
