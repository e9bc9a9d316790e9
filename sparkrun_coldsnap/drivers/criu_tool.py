"""Finding and running CRIU.

A system ``criu`` of version 4.2 or newer is preferred. Older ones fail on
current kernels (3.17 cannot parse the vDSO of 6.x kernels; 4.1 cannot dump
an inet socket on kernels >= 6.16), so where the system has none that works,
``sparkrun coldsnap setup --criu`` unpacks CRIU 4.2.x into a private prefix,
run through that prefix's own dynamic loader because it needs a newer libc
than the host's.
"""

from __future__ import annotations

import platform
import re
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import Completed, run

MIN_VERSION = (4, 2)
_VERSION_RE = re.compile(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")


def _multiarch() -> str:
    return {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(platform.machine(), platform.machine() + "-linux-gnu")


def _loader_name() -> str:
    return {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}.get(platform.machine(), "ld-linux.so.2")


def private_argv(prefix: Path | None = None) -> tuple[str, ...] | None:
    """The command that runs the private CRIU, or None if it is not installed."""
    prefix = Path(prefix or paths.criu_prefix())
    libdir = prefix / "usr" / "lib" / _multiarch()
    loader = libdir / _loader_name()
    binary = prefix / "usr" / "sbin" / "criu"
    if not (loader.exists() and binary.exists()):
        return None
    return (str(loader), "--library-path", str(libdir), str(binary))


@dataclass(frozen=True)
class CriuCandidate:
    source: str  # "system" or "private"
    argv: tuple[str, ...]
    version: str | None
    problem: str | None

    @property
    def usable(self) -> bool:
        return self.problem is None


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = _VERSION_RE.search(text)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def _probe(source: str, argv: tuple[str, ...]) -> CriuCandidate:
    try:
        out = run([*argv, "--version"], timeout=30, check=False, what="criu --version")
    except ToolError as err:
        return CriuCandidate(source, argv, None, str(err))
    v = parse_version(out.stdout + out.stderr)
    if v is None:
        return CriuCandidate(source, argv, None, "criu --version printed no version (exit %d): %s" % (out.returncode, out.tail()))
    version = "%d.%d.%d" % v
    if v[:2] < MIN_VERSION:
        return CriuCandidate(source, argv, version, "criu %s is older than 4.2, which inet sockets need on current kernels" % version)
    return CriuCandidate(source, argv, version, None)


def candidates() -> list[CriuCandidate]:
    """Every CRIU this host offers, system first, each with why it can't be used."""
    out = []
    override = settings.current().criu
    if override:
        out.append(_probe("COLDSNAP_CRIU", override))
    system = shutil.which("criu")
    if system:
        out.append(_probe("system", (system,)))
    private = private_argv()
    if private:
        out.append(_probe("private", private))
    return out


class Criu:
    """A located CRIU: ``dump``, ``restore`` and ``check`` with the project's flags."""

    def __init__(self, candidate: CriuCandidate) -> None:
        self.candidate = candidate
        self.argv = candidate.argv
        self.version = candidate.version or "unknown"
        self.source = candidate.source

    @classmethod
    def locate(cls) -> Criu:
        found = candidates()
        for c in found:
            if c.usable:
                return cls(c)
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
