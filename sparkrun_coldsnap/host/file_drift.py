"""Files a captured process tree depends on, recorded at capture and compared before a restore.

CRIU restores a file mapping or an open file by path and checks what it can (a shared
library's ELF build-ID, every regular file's size); a file that changed since the dump
fails the restore deep inside ``criu restore``, after the old workload was already
evicted. Recording each file the tree maps or holds open lets admission see the change
first, name the file and the package it belongs to, and refuse before anything stops.

What is recorded: size and modification time (the cheap first look), the ELF build-ID
where there is one (what CRIU compares), and either the owning package's name and
version (a host package upgrade) or, for files no package owns (an engine's virtual
environment, a model), a content digest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from pydantic import Field

from sparkrun_coldsnap.digests import sha256_file
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.process_tree import fd_targets, mapped_paths
from sparkrun_coldsnap.host.resident_pages import resident_ranges
from sparkrun_coldsnap.host.runner import run

# Pseudo-files and kernel-provided mappings: not on any file system a host upgrades.
SKIPPED_PREFIXES = ("/proc/", "/sys/", "/dev/", "/memfd:", "/SYSV", "/[", "/anon_inode:")
#: How many drifted files a refusal names before it only counts the rest.
NAMED = 3


class RecordedFile(Strict):
    """A regular file the captured tree mapped or held open."""

    path: str
    size: int
    mtime_ns: int
    build_id: str | None = Field(None, description="The ELF build-ID (GNU note), what CRIU checks for a mapped library.")
    package: str | None = Field(None, description="The host package that owns the file, as name=version; set instead of sha256.")
    sha256: str | None = Field(None, description="Content digest, for files no host package owns.")
    resident: tuple[tuple[int, int], ...] | None = Field(
        None,
        description="Byte ranges (offset, length) of the file whose pages the tree had mapped in at capture: what preparation reads ahead; none: the whole file (not mapped, or recorded before ranges were).",
    )


def build_id(path: str) -> str | None:
    """The GNU build-ID note of an ELF file, or None (not ELF, or built without one)."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for segment in elf.iter_segments():
                if segment.header.p_type != "PT_NOTE":
                    continue
                for note in segment.iter_notes():  # type: ignore[attr-defined]
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        return str(note["n_desc"])
    except (ELFError, OSError, ValueError):
        return None
    return None


def _aliases(path: str) -> list[str]:
    """*path* and the name dpkg may know it by on a merged-/usr host (/usr/lib/x is /lib/x there)."""
    for top in ("/usr/lib/", "/usr/lib64/", "/usr/bin/", "/usr/sbin/"):
        if path.startswith(top):
            return [path, path[len("/usr") :]]
    return [path]


def owners(paths: Iterable[str]) -> dict[str, str]:
    """Which host package owns each of *paths* (``name=version``), where the host can say (dpkg)."""
    alias_of = {alias: path for path in set(paths) for alias in _aliases(path)}
    if not alias_of:
        return {}
    try:
        found = run(["dpkg-query", "-S", *sorted(alias_of)], timeout=120, check=False).stdout
    except ToolError:  # no dpkg here: no package can be named
        return {}
    by_path: dict[str, str] = {}
    for line in found.splitlines():
        names, sep, alias = line.partition(": ")
        if sep and alias in alias_of and "," not in names and not names.startswith("diversion"):
            by_path[alias_of[alias]] = names.strip()
    packages = sorted(set(by_path.values()))
    versions: dict[str, str] = {}
    if packages:
        shown = run(["dpkg-query", "-W", "-f", "${binary:Package}\t${Version}\n", *packages], timeout=120, check=False).stdout
        versions = dict(line.split("\t", 1) for line in shown.splitlines() if "\t" in line)
    return {path: "%s=%s" % (name, versions.get(name, "?")) for path, name in by_path.items()}


def tree_files(pids: Iterable[int]) -> list[str]:
    """The regular files the processes *pids* map or have open (their real paths, sorted)."""
    out: set[str] = set()
    for pid in pids:
        candidates = mapped_paths(pid) | {target for _, target in fd_targets(pid)}
        for path in candidates:
            if path.endswith(" (deleted)") or path.startswith(SKIPPED_PREFIXES) or not path.startswith("/"):
                continue
            if os.path.isfile(path):
                out.add(path)
    return sorted(out)


def record(pids: Iterable[int], *, skip: Iterable[str] = ()) -> tuple[RecordedFile, ...]:
    """What the tree depends on, file by file (*skip*: files recorded elsewhere, such as its log)."""
    skipped = set(skip)
    pids = list(pids)
    paths = [p for p in tree_files(pids) if p not in skipped]
    owned = owners(paths)
    resident = resident_ranges(pids)
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue  # gone since it was listed: nothing a restore could need
        package = owned.get(path)
        out.append(
            RecordedFile(
                path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, build_id=build_id(path), package=package,
                sha256=None if package else sha256_file(Path(path))[0],
                resident=tuple(resident[path]) if path in resident else None,
            )
        )  # fmt: skip
    return tuple(out)


def differences(recorded: Iterable[RecordedFile]) -> list[str]:
    """How each recorded file differs on this host now (empty: none does)."""
    # An upgrade replaces a package's file, which moves its modification time: files whose
    # size and time are as captured are taken as they were, without reading them.
    changed: list[tuple[RecordedFile, str]] = []
    for f in recorded:
        try:
            st = os.stat(f.path)
        except OSError:
            changed.append((f, "missing"))
            continue
        if st.st_size != f.size:
            changed.append((f, "size %d, captured %d" % (st.st_size, f.size)))
            continue
        if st.st_mtime_ns == f.mtime_ns:
            continue  # untouched since capture: the cheap look suffices
        now_id = build_id(f.path)
        if now_id != f.build_id:
            changed.append((f, "build-ID %s, captured %s" % (now_id or "none", f.build_id or "none")))
        elif f.sha256 is not None and sha256_file(Path(f.path))[0] != f.sha256:
            changed.append((f, "content differs"))
    packaged = [f for f, _ in changed if f.package]
    now = owners(f.path for f in packaged)
    out = []
    for f, how in changed:
        if f.package and now.get(f.path) and now[f.path] != f.package:
            how += "; package %s, captured %s" % (now[f.path], f.package)
        elif f.package:
            how += "; package %s at capture" % f.package
        out.append("%s (%s)" % (f.path, how))
    return out


def refusal(drifted: list[str]) -> str:
    """One line: the first few drifted files, how many more, and the fix."""
    shown = "; ".join(drifted[:NAMED])
    more = " and %d more" % (len(drifted) - NAMED) if len(drifted) > NAMED else ""
    return "files the captured workload uses changed since capture: %s%s; recapture (sparkrun coldsnap capture), or set coldsnap.on_incompatible: vanilla" % (shown, more)
