"""A capture's dump ends the tree with SIGKILL, its multiprocessing resource tracker too: the
named semaphores the tracker was left to unlink are removed, not left in /dev/shm."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.host.iouring import io_uring_disabled
from sparkrun_coldsnap.host.process_tree import kill_tree, leaked_semaphores
from sparkrun_coldsnap.launch.local import start_unit

# A tree as vLLM's: processes spawned with multiprocessing, one of which made a semaphore and
# ended without unlinking it (os._exit, as a worker that is killed), so only the tracker would.
LEAKER = """
import multiprocessing as mp, os, sys, time

def leak(q):
    lock = mp.get_context("spawn").Lock()
    q.put(lock._semlock.name)
    os._exit(0)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=leak, args=(q,))
    p.start()
    name = q.get()
    p.join()
    print("ready", name, flush=True)
    time.sleep(3600)
"""


def test_a_capture_removes_the_semaphores_its_killed_tree_left_to_its_resource_tracker(criu, tmp_path):
    script = tmp_path / "leaker.py"
    script.write_text(LEAKER)
    log = tmp_path / "leaker.log"
    with io_uring_disabled():
        unit = start_unit("%s %s" % (sys.executable, script), env={"PATH": "/usr/bin:/bin"}, log_path=log)
        try:
            deadline = time.monotonic() + 60
            while "ready" not in log.read_text():
                assert unit.alive() and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            name = log.read_text().split("ready ", 1)[1].split()[0]
            leaked = Path("/dev/shm/sem." + name.lstrip("/"))
            assert leaked.exists()  # made, and held by nobody now: only the tracker would unlink it
            CpuDriver().checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
        except BaseException:
            kill_tree(unit.root_pid)
            raise
    unit.reap()
    assert not leaked.exists(), "the capture left %s in /dev/shm" % leaked


def test_only_unheld_semaphores_of_the_user_made_since_the_tree_began_count_as_leaked(tmp_path):
    old = tmp_path / "sem.mp-old"
    old.write_bytes(b"\0" * 32)
    time.sleep(0.05)
    since = time.time()
    time.sleep(0.05)
    new, held, other = tmp_path / "sem.mp-new", tmp_path / "sem.mp-held", tmp_path / "psm_1234"
    for p in (new, held, other):
        p.write_bytes(b"\0" * 32)
    fd = os.open(held, os.O_RDONLY)  # this process holds it
    try:
        assert leaked_semaphores(since=since, uid=os.getuid(), shm=tmp_path) == [new]
        assert leaked_semaphores(since=since, uid=os.getuid() + 1, shm=tmp_path) == []
    finally:
        os.close(fd)
