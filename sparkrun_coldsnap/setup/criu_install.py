"""Install CRIU 4.2.x into a private prefix from Debian's packages.

Debian 12's criu (3.17) fails on current kernels and 4.1 cannot dump inet
sockets on kernels >= 6.16, so the embedded default uses 4.2 from Debian's
development suite. Those packages need a newer libc than Debian 12's, so they
are unpacked (never installed) into a prefix together with the libraries
they link, and run through that prefix's own dynamic loader. The mirror comes
from the machine's own apt sources.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host.runner import run

# criu and what it links, from the development suite (criu, its libcompel)
# and the testing suite (the rest, a libc new enough for both).
FROM_SID = ("criu", "libcompel1", "libnet9", "libnl-3-200")
FROM_TRIXIE = (
    "libc6", "libprotobuf-c1", "libnftables1", "libbsd0", "libmnl0", "libnftnl11", "libjansson4", "libxtables12",
    "libedit2", "libgnutls30t64", "libmd0", "libnettle8t64", "libhogweed6t64", "libgmp10", "libp11-kit0",
    "libtasn1-6", "libidn2-0", "libunistring5", "libffi8", "libuuid1",
)  # fmt: skip

_URI_RE = re.compile(r"^URIs:\s*(\S+)", re.M)


def debian_mirror() -> str:
    """The Debian archive URI this machine's apt already uses."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
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
    raise ToolError("no Debian mirror in /etc/apt sources: pass --criu-debs DIR with the .deb files instead")


def download_debs(dest: Path, *, log=print) -> list[Path]:
    mirror = debian_mirror()
    work = Path(tempfile.mkdtemp(prefix="coldsnap-apt-"))
    try:
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "cache" / "archives" / "partial").mkdir(parents=True)
        sources = work / "sources.list"
        sources.write_text("deb %s sid main\ndeb %s trixie main\n" % (mirror, mirror))
        opts = [
            "-o", "Dir::Etc::SourceList=%s" % sources, "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", "Dir::State::Lists=%s" % (work / "lists"), "-o", "Dir::Cache=%s" % (work / "cache"),
            "-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        log("fetching package lists for sid and trixie from %s" % mirror)
        run(["apt-get", *opts, "update"], timeout=600, what="apt-get update (private lists)")
        dest.mkdir(parents=True, exist_ok=True)
        wanted = ["%s/sid" % p for p in FROM_SID] + ["%s/trixie" % p for p in FROM_TRIXIE]
        log("downloading %d packages" % len(wanted))
        run(["apt-get", *opts, "download", *wanted], timeout=600, cwd=str(dest), what="apt-get download")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(dest.glob("*.deb"))


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


def install(prefix: Path, *, debs_dir: Path | None = None, log=print) -> str:
    """Install into *prefix*; returns the version. Fails clearly if it is not >= 4.2."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if debs_dir is not None:
        debs = sorted(Path(debs_dir).glob("*.deb"))
        if not debs:
            raise ToolError("no .deb files in %s" % debs_dir)
    else:
        debs = download_debs(prefix.parent / "criu-debs", log=log)
    unpack(debs, prefix)
    argv = criu_tool.private_argv(prefix)
    if argv is None:
        raise ToolError("the packages unpacked into %s hold no criu binary or loader" % prefix)
    out = run([*argv, "--version"], timeout=30, check=False)
    v = criu_tool.parse_version(out.stdout + out.stderr)
    if v is None or v[:2] < criu_tool.MIN_VERSION:
        raise ToolError("the criu unpacked into %s is %s, not >= 4.2 (the suite moved?): pass --criu-debs with 4.2.x packages" % (prefix, "%d.%d.%d" % v if v else "unrunnable"))
    return "%d.%d.%d" % v
