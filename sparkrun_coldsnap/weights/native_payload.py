"""Native weight payloads on this host: written by the engine at capture, sealed under
their content digest, verified before a restore reads them.

A payload is the engine's own loaded tensors (one file per worker plus an index), so it
is bound to the capsule it was written with, not only to the model. It lives beside
the model files, never inside the capsule: ``<coldsnap home>/native/<sha256>/``.
Deleting it is safe: ``weights: auto`` then falls back to the recovery path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sparkrun_coldsnap.digests import canonical_json, hex_of, sha256_bytes, short
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.engines.base import Endpoint, EngineAdapter
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.host import disk_room, paths
from sparkrun_coldsnap.weights import model_files


def root() -> Path:
    return paths.coldsnap_home() / "native"


def room_problem(model_dir: Path | None) -> str | None:
    """Whether a payload of the model at *model_dir* (its weights as loaded: about its weight
    files' size) has no room where payloads go; the line that says so, else None."""
    weights = model_files.weight_bytes(model_dir) if model_dir else 0
    return disk_room.shortfall(weights, [(root(), 1.0, "the native weight payload (the model's weights as loaded)")])


def directory(record: NativePayload) -> Path:
    return root() / hex_of(record.digest)


def download_dir(record: NativePayload) -> Path:
    """Where a pull of *record* downloads to; it survives an interrupted pull, which the next one resumes."""
    return root() / (".pull-" + hex_of(record.digest))


@contextlib.contextmanager
def _staging() -> Iterator[Path]:
    root().mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=".staging-", dir=root()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def seal(staged: Path) -> NativePayload:
    """Digest the staged files and move them to their content address (kept if already there)."""
    files = model_files.record(staged)
    if not files:
        raise EngineError("the engine wrote no native payload files")
    record = NativePayload(digest=sha256_bytes(canonical_json([f.model_dump(mode="json") for f in files])), files=files)
    _place(staged, record)
    return record


def _place(staged: Path, record: NativePayload) -> Path:
    """Rename *staged* to the payload's content address; an intact copy already there is kept."""
    final = directory(record)
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(staged, 0o755)
        os.rename(staged, final)
    return final


def install(staged: Path, record: NativePayload) -> Path:
    """Move downloaded files, each already checked against its digest, to *record*'s address."""
    missing = sorted(f.name for f in record.files if not (staged / f.name).is_file())
    if missing:
        raise EngineError("native weight payload %s is incomplete: %s missing" % (short(record.digest), ", ".join(missing)))
    return _place(staged, record)


def export(adapter: EngineAdapter, endpoint: Endpoint) -> tuple[NativePayload, tuple[dict, ...]]:
    """Have the serving engine write its payload, then seal it; nothing is left behind on failure."""
    with _staging() as staged:
        reports = adapter.export_native(endpoint, str(staged))
        return seal(staged), reports


def remove(record: NativePayload) -> int:
    """Delete *record*'s payload from this host (and an unfinished pull of it); returns the bytes freed."""
    freed = 0
    for d in (directory(record), download_dir(record)):
        if d.is_dir():
            freed += sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            shutil.rmtree(d, ignore_errors=True)
    return freed


def problems(record: NativePayload) -> list[str]:
    """What stops this host from reading *record* (empty: present and matching)."""
    d = directory(record)
    if not d.is_dir():
        return ["native weight payload %s is not on this host (looked in %s)" % (short(record.digest), d)]
    damaged = model_files.verify(d, record.files)
    if damaged:
        return ["native weight payload %s in %s does not match the capsule (%d file(s) differ)" % (short(record.digest), d, len(damaged))]
    return []
