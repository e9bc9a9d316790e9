"""Debian packages the plugin needs on a host, installed with apt when missing.

``--no-upgrade``: install what is missing, never upgrade what the host has (a library
upgraded under a capsule makes its restores refuse: the fingerprint records it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import netfilter
from sparkrun_coldsnap.host.runner import run


def install(packages: Sequence[str], log: Callable[[str], None]) -> None:
    """apt-get install *packages* (the package lists refreshed once when the first try fails)."""
    if shutil.which("apt-get") is None:
        raise ToolError("no apt-get on this host: install %s with its package manager" % ", ".join(packages))
    log("installing %s" % ", ".join(packages))
    env = settings.current().child_env(DEBIAN_FRONTEND="noninteractive")
    argv = ["apt-get", "install", "-y", "-q", "--no-upgrade", *packages]
    if run(argv, timeout=1200, env=env, check=False).returncode != 0:
        run(["apt-get", "update", "-q"], timeout=600, env=env, what="apt-get update")
        run(argv, timeout=1200, env=env, what="apt-get install %s" % " ".join(packages))


def ensure_iptables(log: Callable[[str], None]) -> None:
    """iptables for a capture or restore across hosts (host/netfilter.py says why)."""
    if netfilter.missing():
        install([netfilter.PACKAGE], log)
    lacking = netfilter.missing()
    if lacking:
        raise ToolError("%s still missing after installing the %s package: put /usr/sbin on PATH" % (", ".join(lacking), netfilter.PACKAGE))
    log("iptables ready (%s)" % shutil.which("iptables"))
