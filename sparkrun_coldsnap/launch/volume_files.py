"""The compile-cache files a captured container's processes use, carried in the capsule.

sparkrun mounts a persistent compile cache into its containers at ``/cache/runtime``
(keyed by model, on the host's sparkrun cache), and the engine maps the kernels it
compiled there (torch inductor's ``.so`` files). CRIU records those mappings by path and
size, so a restore needs the same files at the same paths. On the capture host they
usually stay in the cache; on another host, under another home, or after sparkrun pruned
the cache they are missing, and the restore would fail. So the capture keeps a copy of
each (a few MB), and preparation puts back those missing on the host the new container
mounts, before the container exists. A file present with other content is refused: the
processes would map the wrong code.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from sparkrun_coldsnap.digests import sha256_file
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host import process_tree

#: Where sparkrun mounts its runtime (compile) cache in a container.
CACHE_TARGET = "/cache/runtime"
#: Beside the images in the capsule (the prefix keeps it out of the runtime's checkpoint).
STORED = "coldsnap-volume-files"
INDEX = "index.json"


def cache_paths(paths: Iterable[str]) -> list[str]:
    """Those of *paths* (as the container sees them) that lie under the cache, deleted ones left out."""
    prefix = CACHE_TARGET + "/"
    return sorted({p for p in paths if p.startswith(prefix) and not p.endswith(" (deleted)")})


def in_use(pids: Iterable[int]) -> list[str]:
    """The cache files *pids* map or hold open."""
    seen: set[str] = set()
    for pid in pids:
        seen |= {t for _, t in process_tree.fd_targets(pid)} | process_tree.mapped_paths(pid)
    return cache_paths(seen)


def save(files: Iterable[str], root: Path, images: Path) -> int:
    """Copy *files* (container paths), read under *root* (the container's root seen from the
    host: /proc/PID/root), into *images*; returns how many."""
    files = sorted(files)
    if not files:
        return 0
    target = images / STORED
    index = []
    for path in files:
        copy = target / path.lstrip("/")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path.lstrip("/"), copy)
        digest, size = sha256_file(copy)
        index.append({"path": path, "size": size, "sha256": digest})
    (target / INDEX).write_text(json.dumps(index, indent=1))
    return len(index)


def host_dir(volumes: Mapping[str, str]) -> Path | None:
    """The host directory the container mounts at the cache's path, if it does."""
    for host, container in volumes.items():
        if container.rstrip("/") == CACHE_TARGET:
            return Path(host)
    return None


def put_back(images: Path, volumes: Mapping[str, str]) -> int:
    """Write the saved cache files the new container's cache lacks; returns how many were written."""
    index_path = images / STORED / INDEX
    if not index_path.exists():
        return 0
    root = host_dir(volumes)
    if root is None:
        raise RestoreError("the capsule's processes use files under %s but the recipe mounts nothing there: enable sparkrun's runtime cache (runtime_cache) or recapture" % CACHE_TARGET)
    written = 0
    for entry in json.loads(index_path.read_text()):
        rel = entry["path"][len(CACHE_TARGET) + 1 :]
        dest = root / rel
        if dest.exists():
            if dest.stat().st_size != entry["size"] or sha256_file(dest)[0] != entry["sha256"]:
                raise RestoreError("%s differs from the file the captured processes mapped (%s in the container): remove it so the restore can put the captured one back, or recapture" % (dest, entry["path"]))
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(".%s.coldsnap-tmp" % dest.name)
        shutil.copy2(images / STORED / entry["path"].lstrip("/"), staged)
        os.rename(staged, dest)  # whole or not at all: the cache is shared with vanilla starts
        written += 1
    return written
