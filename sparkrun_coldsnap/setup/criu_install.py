"""Install CRIU 4.2.x into a private prefix from Debian's packages.

Debian 12's criu (3.17) fails on current kernels and 4.1 cannot dump inet
sockets on kernels >= 6.16, so the embedded default uses 4.2 from Debian's
development suite. Those packages need a newer libc than Debian 12's, so they
are unpacked (never installed) into a prefix together with the libraries
they link, and run through that prefix's own dynamic loader. The mirror comes
from the machine's own apt sources, or ``--criu-mirror`` where they name no
Debian archive (Ubuntu, DGX OS). The packages are those of the host's
architecture (amd64 or arm64), fetched with private package lists: the host's
apt state, its architectures included, is left as it was.

Where the distribution itself offers a criu >= 4.2 (``apt-cache policy``),
that package is installed instead.
"""

from __future__ import annotations

import platform
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.setup import debian_packages

# criu and what it links, from the development suite (criu, its libcompel)
# and the testing suite (the rest, a libc new enough for both).
FROM_SID = ("criu", "libcompel1", "libnet9", "libnl-3-200")
FROM_TRIXIE = (
    "libc6", "libprotobuf-c1", "libnftables1", "libbsd0", "libmnl0", "libnftnl11", "libjansson4", "libxtables12",
    "libedit2", "libgnutls30t64", "libmd0", "libnettle8t64", "libhogweed6t64", "libgmp10", "libp11-kit0",
    "libtasn1-6", "libidn2-0", "libunistring5", "libffi8", "libuuid1",
)  # fmt: skip

_URI_RE = re.compile(r"^URIs:\s*(\S+)", re.M)
_CANDIDATE_RE = re.compile(r"^\s*Candidate:\s*(\S+)", re.M)
#: Debian's architecture of a machine (``uname -m``)
DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
MACHINE = {v: k for k, v in DEB_ARCH.items()}


def deb_arch(machine: str | None = None) -> str:
    """Debian's name for the architecture of *machine* (default: this one)."""
    m = machine or platform.machine()
    if m not in DEB_ARCH:
        raise ToolError("no Debian packages of CRIU for a %s machine (known: %s): install a criu >= 4.2 with the distribution's package manager" % (m, ", ".join(DEB_ARCH)))
    return DEB_ARCH[m]


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive URI this machine's apt (configured under *apt_dir*) already uses."""
    texts = []
    for path in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]:
        try:
            texts.append(path.read_text())
        except OSError:
            continue
    for text in texts:
        for uri in _URI_RE.findall(text):
            if "debian" in uri and "security" not in uri and "ports" not in uri:
                return uri.rstrip("/")
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "debian" in parts[1] and "security" not in parts[1]:
                return parts[1].rstrip("/")
    raise ToolError("no Debian mirror in the apt sources under %s (an Ubuntu or DGX OS host names none): for CRIU pass --criu-mirror URL of a Debian archive, or --criu-debs DIR with the .deb files" % apt_dir)


def download_debs(dest: Path, *, arch: str | None = None, mirror: str | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """Download CRIU and what it links, for Debian architecture *arch* (default: this machine's), into *dest*."""
    arch = arch or deb_arch()
    mirror = (mirror or debian_mirror()).rstrip("/")
    work = Path(tempfile.mkdtemp(prefix="coldsnap-apt-"))
    try:
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "cache" / "archives" / "partial").mkdir(parents=True)
        sources = work / "sources.list"
        sources.write_text("deb %s sid main\ndeb %s trixie main\n" % (mirror, mirror))
        # An empty package status: apt resolves these downloads against nothing the host has
        # installed, so another architecture needs no `dpkg --add-architecture` on the host.
        status = work / "status"
        status.write_text("")
        opts = [
            "-o", "Dir::Etc::SourceList=%s" % sources, "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", "Dir::State::Lists=%s" % (work / "lists"), "-o", "Dir::Cache=%s" % (work / "cache"),
            "-o", "Dir::State::status=%s" % status, "-o", "APT::Architecture=%s" % arch, "-o", "APT::Architectures=%s" % arch,
            "-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        log("fetching %s package lists for sid and trixie from %s" % (arch, mirror))
        run(["apt-get", *opts, "update"], timeout=600, what="apt-get update (private lists)")
        # A folder per architecture, emptied first: no package of an earlier download is unpacked.
        dest = dest / arch
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        wanted = ["%s/sid" % p for p in FROM_SID] + ["%s/trixie" % p for p in FROM_TRIXIE]
        log("downloading %d packages" % len(wanted))
        run(["apt-get", *opts, "download", *wanted], timeout=600, cwd=str(dest), what="apt-get download")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(dest.glob("*.deb"))


def check_arch(debs: list[Path], arch: str) -> None:
    """Every package is for *arch* (or for every architecture): carried packages of another refuse."""
    for deb in debs:
        got = run(["dpkg-deb", "-f", str(deb), "Architecture"], timeout=60, what="dpkg-deb -f %s" % deb.name).stdout.strip()
        if got not in (arch, "all"):
            raise ToolError("%s is a package for %s, this host is %s: pass --criu-debs with the %s packages" % (deb, got, arch, arch))


def distribution_candidate() -> str | None:
    """The criu version the host's apt would install (``apt-cache policy``), or None."""
    if shutil.which("apt-cache") is None:
        return None
    out = run(["apt-cache", "policy", "criu"], timeout=120, check=False).stdout
    m = _CANDIDATE_RE.search(out)
    return None if m is None or m.group(1) == "(none)" else m.group(1)


def distribution_suffices(candidate: str | None) -> bool:
    """Is the distribution's candidate (a Debian version string) a criu >= 4.2?"""
    if not candidate:
        return False
    upstream = candidate.split(":", 1)[-1].rsplit("-", 1)[0]
    release, pre, _ = upstream.partition("~")  # "4.2~rc1" comes before 4.2
    v = criu_tool.parse_version("Version: %s" % release.split("+")[0])
    if v is None:
        return False
    return v[:2] > criu_tool.MIN_VERSION if pre else v[:2] >= criu_tool.MIN_VERSION


def unpack(debs: list[Path], prefix: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".criu-", dir=prefix.parent))
    try:
        for deb in debs:
            run(["dpkg-deb", "-x", str(deb), str(staging)], timeout=120, what="dpkg-deb -x %s" % deb.name)
        if prefix.exists():
            shutil.rmtree(prefix)
        staging.rename(prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def emulator(machine: str) -> tuple[str, ...]:
    """How to run a program of *machine* here: directly on that machine, else under qemu's user mode."""
    if machine == platform.machine():
        return ()
    for name in ("qemu-%s" % machine, "qemu-%s-static" % machine):
        found = shutil.which(name)
        if found:
            return (found,)
    raise ToolError("cannot run a %s criu on this %s host: install qemu-user (qemu-%s) to check it" % (machine, platform.machine(), machine))


def install(prefix: Path, *, debs_dir: Path | None = None, arch: str | None = None, mirror: str | None = None, log: Callable[[str], None] = print) -> str:
    """Install into *prefix* the packages of Debian architecture *arch* (default: this machine's);
    returns the version. Fails clearly if it is not >= 4.2."""
    arch = arch or deb_arch()
    if arch not in MACHINE:
        raise ToolError("unknown architecture %r: use one of %s" % (arch, ", ".join(MACHINE)))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if debs_dir is not None:
        debs = sorted(Path(debs_dir).glob("*.deb"))
        if not debs:
            raise ToolError("no .deb files in %s" % debs_dir)
        check_arch(debs, arch)
    else:
        debs = download_debs(prefix.parent / "criu-debs", arch=arch, mirror=mirror, log=log)
    unpack(debs, prefix)
    argv = criu_tool.private_argv(prefix, MACHINE[arch])
    if argv is None:
        raise ToolError("the packages unpacked into %s hold no criu binary or loader" % prefix)
    out = run([*emulator(MACHINE[arch]), *argv, "--version"], timeout=60, check=False)
    v = criu_tool.parse_version(out.stdout + out.stderr)
    if v is None or v[:2] < criu_tool.MIN_VERSION:
        raise ToolError("the criu unpacked into %s is %s, not >= 4.2 (the suite moved?): pass --criu-debs with 4.2.x packages" % (prefix, "%d.%d.%d" % v if v else "unrunnable"))
    return "%d.%d.%d" % v


def ensure(prefix: Path, *, debs_dir: Path | None = None, arch: str | None = None, mirror: str | None = None, log: Callable[[str], None] = print) -> str:
    """Get a criu >= 4.2 for Debian architecture *arch* (default: this machine's), the cheapest way
    this host allows; returns one line saying what was done.

    Carried packages are unpacked as given; else the distribution's criu when its candidate is
    >= 4.2 (for this machine's own architecture only); else Debian's packages into *prefix*.
    """
    here = deb_arch()
    arch = arch or here
    if debs_dir is not None:
        v = install(prefix, debs_dir=debs_dir, arch=arch, log=log)
        return "criu %s ready: the %s packages of %s unpacked into %s" % (v, arch, debs_dir, prefix)
    if arch == here:
        candidate = distribution_candidate()
        if distribution_suffices(candidate):
            debian_packages.install(["criu"], log)
            found = criu_tool.Criu.locate()
            return "criu %s ready: the distribution's package (%s, %s) installed at %s" % (found.version, candidate, arch, found.candidate.path)
        why = "the distribution offers criu %s, older than 4.2" % candidate if candidate else "the distribution offers no criu package"
    else:
        why = "for %s, not this %s host: the distribution's criu does not apply" % (arch, here)
    log("installing CRIU 4.2 (Debian's %s packages) into %s: %s" % (arch, prefix, why))
    v = install(prefix, arch=arch, mirror=mirror, log=log)
    return "criu %s ready: Debian's %s packages unpacked into %s (%s)" % (v, arch, prefix, why)
