"""CRIU's record of what the kernel offers, kept where CRIU looks for it.

Every CRIU run starts by learning what the kernel offers: dozens of probes, and, as root,
``iptables`` run three times (``iptables -L`` and ``ip6tables -L`` to load the netfilter
modules, ``iptables -w -L`` to learn whether it takes a lock) and the socket modules loaded. CRIU keeps what it learned in ``/run/criu.kdat`` and
reads that on later runs instead, but it writes the file only where ``/run`` is a tmpfs, so
that a reboot into another kernel cannot leave it stale. Where ``/run`` is an ordinary disk
(virtual machines, some container images) every run probes again. Alone that costs about
30 ms; beside the copy of the weights into memory on a node with nothing prepared, the
programs it runs wait behind the copy's reads: ``criu restore`` of the tiny CPU vLLM took
4.5 s there instead of 0.34 s with the record (``benchmarks/restore_beside_reads_probe.py``).

So before a restore, off its clock, the record is made where it is missing: CRIU runs once in
a mount namespace of its own whose ``/run`` is a tmpfs, where it writes the record, and the
record is put at ``/run/criu.kdat``, which CRIU reads on any file system. Such a record is the
plugin's to keep fresh: a note beside it says which boot and which CRIU made it, and one made
in another boot or by another CRIU is made again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.criu.page_fill import on_tmpfs
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.facts import boot_id
from sparkrun_coldsnap.host.runner import run

RUN = Path("/run")
KDAT = RUN / "criu.kdat"
#: who made the record at :data:`KDAT` (the boot, the CRIU): a record without it is not the plugin's
NOTE = RUN / "sparkrun-coldsnap" / "criu-kdat.json"


def ensure(criu: Criu) -> dict[str, Any]:
    """Have the record of the kernel's features at :data:`KDAT` before CRIU runs on a clock;
    what was found or done, for the receipt. Never raises: without it CRIU only probes."""
    if os.geteuid() != 0:
        return {"skipped": "not root: CRIU keeps its record under XDG_RUNTIME_DIR itself"}
    made_by = {"boot_id": boot_id(), "criu": list(criu.argv), "version": criu.version}
    if on_tmpfs(RUN):
        if KDAT.is_file():
            return {"record": "kept by CRIU"}  # a tmpfs /run starts empty at each boot
    elif KDAT.is_file() and _note() == made_by:
        return {"record": "kept"}
    t = time.monotonic()
    try:
        _make(criu)
        if not on_tmpfs(RUN):
            NOTE.parent.mkdir(parents=True, exist_ok=True)
            NOTE.write_text(json.dumps(made_by))
    except (OSError, RuntimeError, ColdsnapError) as err:  # a timeout of criu check among them
        return {"skipped": "CRIU's record of the kernel's features could not be made: %s" % err}
    return {"record": "made", "seconds": round(time.monotonic() - t, 4)}


def state(criu: Criu) -> str:
    """Where the record stands, in words (``doctor``); changes nothing."""
    if on_tmpfs(RUN):
        return "/run is a tmpfs: CRIU keeps its record of the kernel's features there itself (%s)" % ("present" if KDAT.is_file() else "written by its next run")
    if KDAT.is_file() and _note() == {"boot_id": boot_id(), "criu": list(criu.argv), "version": criu.version}:
        return "/run is not a tmpfs: the plugin keeps CRIU's record of the kernel's features at %s (made this boot, by this CRIU)" % KDAT
    return "/run is not a tmpfs, so CRIU probes the kernel at every run (running iptables among others); a restore's preparation makes %s for it" % KDAT


def _note() -> dict[str, Any] | None:
    try:
        return json.loads(NOTE.read_text())
    except (OSError, ValueError):
        return None


def _make(criu: Criu) -> None:
    """CRIU's probes run once, by ``criu check``; where /run is not a tmpfs, in a mount
    namespace of their own with a tmpfs there, the record copied out and put in place."""
    if on_tmpfs(RUN):
        criu.run(["check"], timeout=120, what="criu check")  # CRIU writes the record itself
        if not KDAT.is_file():
            raise RuntimeError("criu check wrote no %s" % KDAT)
        return
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("no unshare on PATH (util-linux)")
    paths.run_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="criu-kdat-", dir=paths.run_dir()) as tmp:
        made = Path(tmp) / "criu.kdat"
        script = 'mount -t tmpfs -o size=4m coldsnap-kdat /run && "$@" check >/dev/null 2>&1; cp /run/criu.kdat "$0"'
        run([unshare, "--mount", "--propagation", "private", "--", "sh", "-c", script, str(made), *criu.argv], timeout=120, check=False, what="criu check in a mount namespace of its own")
        if not made.is_file() or made.stat().st_size == 0:
            raise RuntimeError("criu check wrote no record under a private /run")
        part = KDAT.with_name(KDAT.name + ".coldsnap-%d" % os.getpid())
        shutil.copyfile(made, part)
        os.chmod(part, 0o600)
        os.replace(part, KDAT)  # whole or not at all: CRIU may read it at any moment
