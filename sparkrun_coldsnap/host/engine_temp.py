"""vLLM's files in the temporary directory that outlive its engine, removed once nothing uses them.

vLLM binds its ZMQ sockets to ``<tmp>/<uuid4>`` and initializes torch.distributed through
``<tmp>/vllm_dist_<hex>``; an engine that is killed rather than shut down removes neither.
The plugin kills engines: a capture stops the tree it has dumped, a failed start is
stopped, and ``sparkrun stop`` kills a restored tree. So after such a stop, and before a
restore serves, the files of that kind that no process uses are removed.

"Uses" is checked across network namespaces: a tree restored into one of its own binds
its sockets there, and the host's /proc/net/unix does not list them.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path

import psutil

from sparkrun_coldsnap.host.process_tree import fd_targets

_SOCKET = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DIST = re.compile(r"^vllm_dist_[0-9a-f]{32}$")
#: a file younger than this may belong to an engine still starting (bound or opened next)
MIN_AGE = 30.0


def temp_dir() -> Path:
    return Path(tempfile.gettempdir())


def engine_files(directory: Path | None = None) -> list[Path]:
    """vLLM's socket files and torch.distributed init files in *directory* (default: the temp dir)."""
    directory = directory or temp_dir()
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for e in entries:
        try:
            mode = e.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        if (_SOCKET.match(e.name) and stat.S_ISSOCK(mode)) or (_DIST.match(e.name) and stat.S_ISREG(mode)):
            out.append(Path(e.path))
    return out


def _bound_paths(pid: int) -> set[str]:
    """Paths of the unix sockets bound in *pid*'s network namespace."""
    out = set()
    try:
        with open("/proc/%d/net/unix" % pid) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith("/"):
                    out.add(parts[7])
    except OSError:
        pass
    return out


def in_use() -> set[str]:
    """Every path a process has open, and every socket path bound, in any network namespace."""
    used: set[str] = set()
    namespaces: set[str] = set()
    for pid in psutil.pids():
        try:
            ns = os.readlink("/proc/%d/ns/net" % pid)
        except OSError:
            continue
        if ns not in namespaces:
            namespaces.add(ns)
            used |= _bound_paths(pid)
        used |= {target for _, target in fd_targets(pid)}
    return used


def sweep(directory: Path | None = None, *, min_age: float = MIN_AGE, keep: frozenset[str] = frozenset()) -> list[Path]:
    """Remove the engine files nothing uses (and older than *min_age* seconds, not in *keep*:
    files a capsule's images name, which its restore needs); returns them."""
    candidates = engine_files(directory)
    if not candidates:
        return []
    used = in_use()
    now = time.time()
    removed = []
    for p in candidates:
        try:
            if str(p) in used or str(p) in keep or now - p.lstat().st_mtime < min_age:
                continue
            p.unlink()
            removed.append(p)
        except OSError:
            continue
    return removed
