"""kill -9 of the plugin's own process mid-capture, for real: the engine it started and the
io_uring switch it turned off are found and undone by the next capture (or gc --yes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from registry_fixtures import free_port
from test_criu_driver import wait_http

from sparkrun_coldsnap.host import leftovers
from sparkrun_coldsnap.host.iouring import SYSCTL

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "tests" / "workloads" / "server.py"

PLUGIN = """
import os, signal, sys, time
sys.path.insert(0, %(tests)r)
from pathlib import Path
from sparkrun_coldsnap.host import leftovers
from sparkrun_coldsnap.host.iouring import io_uring_disabled
from sparkrun_coldsnap.launch.local import start_unit
with io_uring_disabled():
    unit = start_unit(%(cmd)r, env={"PATH": "/usr/bin:/bin"}, log_path=Path(%(log)r))
    leftovers.adopt(unit.root_pid, "the engine of a capture of test:latest")
    print(unit.root_pid, flush=True)
    while "ready" not in Path(%(log)r).read_text():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)  # killed outright, mid-capture
"""


def test_what_a_killed_capture_left_is_undone(tmp_path):
    port = free_port()
    before = SYSCTL.read_text().strip()
    log = tmp_path / "engine.log"
    code = PLUGIN % {"tests": str(ROOT / "tests"), "cmd": "%s %s --port %d" % (sys.executable, SERVER, port), "log": str(log)}
    cp = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert cp.returncode == -signal.SIGKILL, cp.stderr
    root = int(cp.stdout.split()[0])
    try:
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"  # the stray engine serves on
        if before != "2":
            assert SYSCTL.read_text().strip() == "2"  # and io_uring is still off
        recovered = leftovers.recover()
        assert any("pid %d" % root in s for s in recovered.stopped), recovered
        deadline = time.monotonic() + 10
        while psutil.pid_exists(root) and psutil.Process(root).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the stray engine was not stopped"
            time.sleep(0.05)
        if before != "2":
            assert recovered.io_uring == before and SYSCTL.read_text().strip() == before
        assert leftovers.recover().stopped == ()  # nothing left to undo
    finally:
        if psutil.pid_exists(root):
            from sparkrun_coldsnap.host.process_tree import kill_tree

            kill_tree(root, grace=1.0)
