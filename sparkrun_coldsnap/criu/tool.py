"""Finding and running CRIU.

A system ``criu`` of version 4.2 or newer is preferred. Older ones fail on
current kernels (3.17 cannot parse the vDSO of 6.x kernels; 4.1 cannot dump
an inet socket on kernels >= 6.16), so where the system has none that works,
``sparkrun coldsnap setup --criu`` unpacks CRIU 4.2.x into a private prefix,
run through that prefix's own dynamic loader because it needs a newer libc
than the host's.

``setup --docker`` copies that private CRIU to a root-owned host-wide prefix
(:data:`HOST_PREFIX`) and puts a two-line wrapper of the copy first on PATH
(:data:`WRAPPER`), because runc runs whichever ``criu`` PATH gives it, for every
user's docker. That wrapper is recognized as what it is, never taken for the
distribution's CRIU.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import Completed, run

MIN_VERSION = (4, 2)
#: where ``setup --docker`` writes the wrapper runc runs, and the line that marks it as ours
WRAPPER = Path("/usr/local/sbin/criu")
WRAPPER_MARK = "# CRIU 4.2 from the private prefix, for runc."
#: where ``setup --docker`` copies the private CRIU for that wrapper: owned by root and the same
#: for every user, so what runc runs does not depend on whose home ran the set-up
HOST_PREFIX = Path("/usr/local/lib/sparkrun-coldsnap/criu")
DPKG_LIST = Path("/var/lib/dpkg/info/criu.list")
#: where CRIU looks for its plugins: compiled in (``/usr/lib/criu`` for every build here), the
#: host's folder even for the private prefix's CRIU
PLUGIN_DIR = Path("/usr/lib/criu")
_VERSION_RE = re.compile(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")


#: per machine (``uname -m``): the multiarch triplet of its library folder and its dynamic loader
_MACHINES = {
    "x86_64": ("x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": ("aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}


def _machine_paths(machine: str | None = None) -> tuple[str, str]:
    m = machine or platform.machine()
    if m not in _MACHINES:
        raise ToolError("no private CRIU layout for a %s machine (known: %s): install a criu >= 4.2 with the distribution's package manager" % (m, ", ".join(_MACHINES)))
    return _MACHINES[m]


def _multiarch(machine: str | None = None) -> str:
    return _machine_paths(machine)[0]


def _loader_name(machine: str | None = None) -> str:
    return _machine_paths(machine)[1]


def private_argv(prefix: Path | None = None, machine: str | None = None) -> tuple[str, ...] | None:
    """The command that runs the private CRIU, or None if it is not installed.

    *machine* (``uname -m``; default this one's) picks the loader: a prefix unpacked for
    another machine is run by that machine's loader (under an emulator, in the tests).
    """
    prefix = Path(prefix or paths.criu_prefix())
    try:
        triplet, loader_name = _machine_paths(machine)
    except ToolError:
        return None
    libdir = prefix / "usr" / "lib" / triplet
    loader = libdir / loader_name
    binary = prefix / "usr" / "sbin" / "criu"
    if not (loader.exists() and binary.exists()):
        return None
    return (str(loader), "--library-path", str(libdir), str(binary))


def wrapper_script(private: Sequence[str]) -> str:
    """The wrapper runc runs: exec the private CRIU through its loader."""
    return '#!/bin/sh\n%s\nexec %s "$@"\n' % (WRAPPER_MARK, " ".join(shlex.quote(a) for a in private))


def wrapped_argv(path: Path) -> tuple[str, ...] | None:
    """The command a ``criu`` wrapper written by ``setup --docker`` runs; None for anything else."""
    try:
        if path.stat().st_size > 4096:
            return None
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    if WRAPPER_MARK not in text:
        return None
    for line in text.splitlines():
        if line.startswith("exec "):
            words = shlex.split(line)[1:]
            return tuple(w for w in words if w != "$@") or None
    return None


def on_path() -> list[Path]:
    """Every distinct ``criu`` on PATH, in PATH order (the first is what runc runs)."""
    seen: set[Path] = set()
    out = []
    for d in os.get_exec_path():
        p = Path(d or ".") / "criu"
        if not (p.is_file() and os.access(p, os.X_OK)):
            continue
        real = p.resolve()
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


def packaged(path: Path) -> bool:
    """Does the distribution's ``criu`` package own *path*?"""
    try:
        return str(path.resolve()) in {l.strip() for l in DPKG_LIST.read_text().splitlines()}
    except OSError:
        return False


@dataclass(frozen=True)
class CriuCandidate:
    #: "COLDSNAP_CRIU"; "distribution" (its package's criu); "system" (another criu on PATH);
    #: "private" (unpacked by setup); "wrapper" (the runc wrapper of a private CRIU)
    source: str
    argv: tuple[str, ...]
    version: str | None
    problem: str | None
    path: str = ""

    @property
    def usable(self) -> bool:
        return self.problem is None


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = _VERSION_RE.search(text)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def _probe(source: str, argv: tuple[str, ...], path: str = "") -> CriuCandidate:
    path = path or argv[-1]
    try:
        out = run([*argv, "--version"], timeout=30, check=False, what="criu --version")
    except ToolError as err:
        return CriuCandidate(source, argv, None, str(err), path)
    v = parse_version(out.stdout + out.stderr)
    if v is None:
        return CriuCandidate(source, argv, None, "criu --version printed no version (exit %d): %s" % (out.returncode, out.tail()), path)
    version = "%d.%d.%d" % v
    if v[:2] < MIN_VERSION:
        return CriuCandidate(source, argv, version, "criu %s is older than 4.2, which inet sockets need on current kernels" % version, path)
    return CriuCandidate(source, argv, version, None, path)


def probe_path(path: Path) -> CriuCandidate:
    """What a ``criu`` on PATH is: the runc wrapper of a private CRIU, the distribution's, or another."""
    wrapped = wrapped_argv(path)
    if wrapped is not None:
        return _probe("wrapper", wrapped, str(path))
    return _probe("distribution" if packaged(path) else "system", (str(path),))


def candidates() -> list[CriuCandidate]:
    """Every CRIU this host offers, each with why it can't be used: an override, the ones on
    PATH (a wrapper of a private CRIU last among them), then the private one."""
    return list(_candidates())


def _candidates() -> Iterator[CriuCandidate]:
    """:func:`candidates` in order, each probed (``criu --version`` run) only when reached."""
    override = settings.current().criu
    if override:
        yield _probe("COLDSNAP_CRIU", override)
    found = on_path()
    wrappers = [p for p in found if wrapped_argv(p) is not None]
    for p in found:
        if p not in wrappers:
            yield probe_path(p)
    private = private_argv()
    if private:
        yield _probe("private", private)
    for p in wrappers:
        yield probe_path(p)


def for_runc() -> CriuCandidate | None:
    """The CRIU runc runs (the first ``criu`` on PATH), or None when PATH has none."""
    found = on_path()
    return probe_path(found[0]) if found else None


def plugin_files() -> tuple[Path, ...]:
    """The plugins CRIU loads (``*.so`` in :data:`PLUGIN_DIR`). Listing the folder here also
    brings its entries into memory: CRIU lists it at every run, and on a node with nothing
    prepared that lookup waited behind the weights' reads."""
    try:
        return tuple(sorted(p.resolve() for p in PLUGIN_DIR.iterdir() if p.name.endswith(".so") and p.is_file()))
    except OSError:
        return ()


def program_files() -> tuple[Path, ...]:
    """The files of every CRIU a restore may run, found without running one: the override's
    and PATH's programs, the private prefix's loader, program and libraries (its own libc
    among them, which no host process has in memory), and the plugins CRIU loads. Read during
    preparation, they keep ``criu restore`` from faulting its code in page by page from a disk
    busy with the weights."""
    argvs = [tuple(settings.current().criu or ())] + [wrapped_argv(p) or (str(p),) for p in on_path()] + [private_argv() or ()]
    out: list[Path] = []
    for argv in argvs:
        words = list(argv)
        for i, word in enumerate(words):
            path = Path(word)
            if i and words[i - 1] == "--library-path" and path.is_dir():
                out += sorted(f for f in path.iterdir() if f.is_file() and not f.is_symlink())
            elif path.is_absolute() and path.is_file():
                out.append(path.resolve())
    return tuple(dict.fromkeys(out + list(plugin_files())))


class Criu:
    """A located CRIU: ``dump``, ``restore`` and ``check`` with the project's flags."""

    def __init__(self, candidate: CriuCandidate) -> None:
        self.candidate = candidate
        self.argv = candidate.argv
        self.version = candidate.version or "unknown"
        self.source = candidate.source

    @classmethod
    def locate(cls) -> Criu:
        # The first usable one ends the search: a restore locates CRIU on its clock, and each
        # candidate probed is a ``criu --version`` run.
        found = []
        for c in _candidates():
            if c.usable:
                return cls(c)
            found.append(c)
        why = "; ".join("%s: %s" % (c.source, c.problem) for c in found) or "no criu on PATH and none installed privately"
        raise ToolError("no usable CRIU >= 4.2 (%s): run `sparkrun coldsnap setup --criu` or install criu 4.2+" % why)

    def run(self, args: Sequence[str], *, timeout: float = 600, pass_fds: Sequence[int] = (), env: Mapping[str, str] | None = None, what: str = "criu") -> Completed:
        return run([*self.argv, *args], timeout=timeout, check=False, pass_fds=pass_fds, env=env, what=what)

    def check(self) -> tuple[bool, str]:
        out = self.run(["check"], timeout=60, what="criu check")
        text = (out.stdout + out.stderr).strip()
        return out.returncode == 0, text.splitlines()[-1] if text else "exit %d" % out.returncode


def log_tail(log_path: Path, lines: int = 4) -> str:
    """The last error lines of a CRIU log, without the rlimit line it always prints."""
    try:
        text = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return "no criu log was written"
    # The rlimit line is harmless and always there: quoting it would blame the wrong thing.
    text = [l for l in text if "RLIMIT_NOFILE" not in l and l.strip()]
    errors = [l for l in text if "Error" in l]
    if not errors:
        return "its log has no error line (last: %s)" % text[-1].strip() if text else "its log is empty"
    return " | ".join(l.strip() for l in errors[-lines:])


def how_it_ended(returncode: int) -> str:
    """A CRIU exit status in words: a signal is named (a kill from outside, not CRIU's own error)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return "was ended by signal %d (%s) before it finished" % (-returncode, name)
    return "failed (exit %d)" % returncode
