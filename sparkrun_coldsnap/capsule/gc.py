"""Garbage in a capsule store: what nothing needs any more, shown before it is freed.

Three kinds, all left by deletes and interrupted writes:

* blobs no tagged manifest reaches (a deleted capsule's layers, or blobs a killed write moved
  into ``blobs/`` before it could tag them);
* staging directories of operations that are over: each name carries its creator's PID
  (``host.atomic.owned_prefix``), and one whose creator is gone and that no live process
  still uses (a ``criu lazy-pages`` daemon serving a restore's images) is garbage; this
  covers the store's ``.staging/`` and the memory staging area;
* partial transfers (``.staging/uploads``, ``.staging/downloads``): what an interrupted
  publish or pull resumes from. Only an explicit ``gc`` frees them.

Everything is decided under the store lock, which writers hold while they add blobs and tag them.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sparkrun_coldsnap.digests import hex_of
from sparkrun_coldsnap.errors import StoreError
from sparkrun_coldsnap.host.atomic import explain_os_error, owner_pid

if TYPE_CHECKING:
    from sparkrun_coldsnap.capsule.store import CapsuleStore

TRANSFERS = ("uploads", "downloads")
MEMORY_STAGING = "coldsnap-staging"


@dataclass
class Garbage:
    blobs: list[tuple[Path, int]] = field(default_factory=list)
    staging: list[tuple[Path, int]] = field(default_factory=list)
    transfers: list[tuple[Path, int]] = field(default_factory=list)

    @property
    def items(self) -> list[tuple[Path, int]]:
        return self.blobs + self.staging + self.transfers

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.items)

    def to_json(self) -> dict:
        def rows(xs: list[tuple[Path, int]]) -> list[dict]:
            return [{"path": str(p), "bytes": n} for p, n in xs]

        return {"blobs": rows(self.blobs), "staging": rows(self.staging), "transfers": rows(self.transfers), "bytes": self.bytes}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat(follow_symlinks=False).st_blocks * 512  # sparse images: what is held
        except OSError:
            continue
    return total


def _in_use(directory: Path) -> bool:
    """A live process names *directory* on its command line or holds a file under it open."""
    text = str(directory)
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(text in arg for arg in proc.info["cmdline"] or ()):
                return True
            if any(f.path.startswith(text + os.sep) for f in proc.open_files()):
                return True
        except (psutil.Error, OSError):
            continue
    return False


# A directory whose name carries no PID (made before names carried one) is garbage only once it
# has not changed for this long: its owner may be waiting at a barrier between prepare and activate.
UNOWNED_AGE_SECONDS = 3600.0


def _stale(directory: Path) -> bool:
    pid = owner_pid(directory.name)
    if pid is None:
        try:
            if time.time() - directory.stat().st_mtime < UNOWNED_AGE_SECONDS:
                return False
        except OSError:
            return False
    if pid is not None and pid != os.getpid() and psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    if pid == os.getpid():
        return False
    return not _in_use(directory)


def _staging_roots(store: CapsuleStore) -> list[Path]:
    from sparkrun_coldsnap.documents import settings

    roots = [store.staging]
    memory = settings.current().memory_staging
    if memory is not None:
        roots.append(memory / MEMORY_STAGING)
    return roots


def find(store: CapsuleStore, *, transfers: bool) -> Garbage:
    """What *store* holds that nothing needs (call with the store lock held)."""
    out = Garbage()
    keep = {hex_of(d) for d in store.referenced_blobs()}
    if store.blobs.is_dir():
        for p in sorted(store.blobs.iterdir()):
            if p.name not in keep:
                out.blobs.append((p, _size(p)))
    for root in _staging_roots(store):
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            if p.name in TRANSFERS and root == store.staging:
                if transfers:
                    out.transfers += [(q, _size(q)) for q in sorted(p.iterdir())]
            elif _stale(p):
                out.staging.append((p, _size(p)))
    return out


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as err:
        raise StoreError(explain_os_error(err, path)) from err


def collect_locked(store: CapsuleStore, *, apply: bool, transfers: bool) -> Garbage:
    garbage = find(store, transfers=transfers)
    if apply:
        for path, _ in garbage.items:
            _remove(path)
        for root in _staging_roots(store)[1:]:
            try:
                root.rmdir()  # the memory staging folder, once empty, goes too (it is on the host's /dev/shm)
            except OSError:
                pass
    return garbage


def collect(store: CapsuleStore, *, apply: bool, transfers: bool = True) -> Garbage:
    """What is garbage in *store* (freed when *apply*); the dry run changes nothing."""
    store.check_directory()
    if not store.exists():
        return Garbage()
    with store.locked():
        return collect_locked(store, apply=apply, transfers=transfers)
