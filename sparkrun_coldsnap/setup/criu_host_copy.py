"""A root-owned, host-wide copy of the private CRIU, for the wrapper runc runs.

``setup --criu`` unpacks CRIU into the home of whoever ran it. The ``criu`` that
``setup --docker`` puts on PATH serves every user's docker, so it must not run a
program in one home: another user's home may not be readable, a home may move, and a
later ``setup --criu`` by that user would change what every container's checkpoint runs.
The prefix is copied to :data:`~sparkrun_coldsnap.criu.tool.HOST_PREFIX` instead, made
again only where it differs, and swapped in whole (a copy is never half there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

from sparkrun_coldsnap.errors import ToolError

Manifest = tuple[tuple[str, str, int, str], ...]


def manifest(prefix: Path) -> Manifest:
    """What the prefix holds: each entry's relative path, kind, mode and content (a file's
    digest, a link's target). Empty when there is no prefix."""
    if not prefix.is_dir():
        return ()
    out = []
    for path in sorted(prefix.rglob("*")):
        rel = str(path.relative_to(prefix))
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            out.append((rel, "link", 0, os.readlink(path)))
        elif stat.S_ISDIR(st.st_mode):
            out.append((rel, "dir", stat.S_IMODE(st.st_mode) & 0o755, ""))
        elif stat.S_ISREG(st.st_mode):
            with path.open("rb") as f:
                out.append((rel, "file", stat.S_IMODE(st.st_mode) & 0o755, hashlib.file_digest(f, "sha256").hexdigest()))
    return tuple(out)


def _check_links(prefix: Path, entries: Manifest) -> None:
    """A link that leaves the prefix would keep the copy depending on where it points."""
    for rel, kind, _, target in entries:
        if kind != "link":
            continue
        resolved = os.path.normpath(os.path.join(prefix, os.path.dirname(rel), target))
        if os.path.isabs(target) or not (resolved + os.sep).startswith(str(prefix) + os.sep):
            raise ToolError("the private CRIU's %s links to %s, outside %s: run `sparkrun coldsnap setup --criu` again to unpack it afresh" % (prefix / rel, target, prefix))


def install(source: Path, dest: Path) -> bool:
    """Make *dest* a root-owned copy of *source* (no group or other write); True if it changed."""
    wanted = manifest(source)
    if not wanted:
        raise ToolError("no private CRIU at %s to copy for runc: run `sparkrun coldsnap setup --criu` first" % source)
    _check_links(source, wanted)
    if manifest(dest) == wanted and _root_owned(dest):
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(".%s.new-%d" % (dest.name, os.getpid()))
    old = dest.with_name(".%s.old-%d" % (dest.name, os.getpid()))
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(source, staging, symlinks=True)
        for path in (staging, *staging.rglob("*")):
            if not path.is_symlink():
                os.chown(path, 0, 0)
                path.chmod(stat.S_IMODE(path.lstat().st_mode) & 0o755)
        if dest.exists():
            dest.rename(old)
        try:
            staging.rename(dest)
        except OSError:
            if old.exists():
                old.rename(dest)  # the copy that was there stays
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return True


def _root_owned(prefix: Path) -> bool:
    return all(p.lstat().st_uid == 0 and not p.lstat().st_mode & 0o022 for p in (prefix, *prefix.rglob("*")) if not p.is_symlink())
