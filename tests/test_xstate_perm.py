"""The AMX tile permission asked for from inside another process (host/xstate_perm.py): a
process blocked in a system call, running or stopped, gets the permission and then goes on
as if never interrupted: the call it was in is made again, not ended with EINTR or with the
kernel's restart code (-512) leaking out.

The workload asks the kernel itself (``ARCH_GET_XCOMP_PERM``) and prints what it sees, so
what is checked is the permission the process holds, not what the injection reported. Then
every way a tree comes back from real CRIU images (stopped for the memory fill, running with
memory on demand or every page copied, in the host's namespaces or its own) gives each of its
processes the permission back, and the tree answers as before: the calls it was blocked in
were made again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from test_zero_pages import PAGES, continues_as_dumped, digest, dump_pattern

from sparkrun_coldsnap.criu import page_fill
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.host import xstate_perm
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids
from sparkrun_coldsnap.host.xstate_perm import _ERESTART_RESTARTBLOCK, _NO_SYSCALL, _ORIG_RAX, _RAX, _RIP, _Regs

TILES = 1 << 18  # XFEATURE_XTILEDATA
needs_tiles = pytest.mark.skipif(not xstate_perm.tiles_supported(), reason="this host's CPU or kernel offers no AMX tile data (x86 with AMX and Linux 5.16 or later)")

# Raw libc calls, not Python's: Python retries a call that fails with EINTR (PEP 475), which
# would hide the very failure looked for.
BLOCKED = r"""
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)

def perm():
    mask = ctypes.c_ulonglong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0  # ARCH_GET_XCOMP_PERM
    return mask.value

def read():
    buf = ctypes.create_string_buffer(64)
    n = libc.read(0, buf, 64)
    return "read %d %r errno %d" % (n, buf.raw[: max(n, 0)].decode(), ctypes.get_errno())

def poll():
    class PollFd(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]
    fd = PollFd(0, 1, 0)  # POLLIN
    n = libc.poll(ctypes.byref(fd), 1, 30000)  # a timeout: restarted through restart_syscall
    return "poll %d errno %d; %s" % (n, ctypes.get_errno(), read())

def sleep():
    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
    t = time.monotonic()
    rc = libc.nanosleep(ctypes.byref(Timespec(2, 0)), None)  # restarted for the time left
    return "sleep %d errno %d slept %.3f" % (rc, ctypes.get_errno(), time.monotonic() - t)

def select():
    class Timeval(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]
    t = time.monotonic()
    rc = libc.select(0, None, None, None, ctypes.byref(Timeval(2, 0)))  # ERESTARTNOHAND
    return "select %d errno %d slept %.3f" % (rc, ctypes.get_errno(), time.monotonic() - t)

mode = sys.argv[1]
if mode == "tree":
    child = os.fork()
    if child == 0:
        print("child", read(), "perm", perm(), flush=True)
        os._exit(0)
    print("ready", perm(), flush=True)
    os.waitpid(child, 0)  # the parent blocked in wait4 meanwhile
    print("parent perm", perm(), flush=True)
    sys.exit(0)
seen = {}
threaded = mode == "threads"
if threaded:
    # A second thread runs on through the injection, then sees the permission too: it is the process's.
    done = threading.Event()
    ticks = [0]
    def spin():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)
        seen["thread"] = perm()
    worker = threading.Thread(target=spin)
    worker.start()
    mode = "read"
print("ready", perm(), flush=True)
said = {"read": read, "poll": poll, "sleep": sleep, "select": select}[mode]()
if threaded:
    done.set()
    worker.join()
    said += " ticks %d thread perm %d" % (ticks[0], seen["thread"])
print(said, "perm", perm(), flush=True)
"""

SYSCALLS = {"read": 0, "poll": 7, "sleep": 230, "select": 270, "threads": 0, "tree": 61}  # glibc: clock_nanosleep, pselect6


def start(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready" and not int(ready[1]) & TILES, ready  # a fresh process has not asked
    await_blocked(proc.pid, SYSCALLS[mode])
    return proc


def blocked_in(pid: int) -> int | None:
    with open("/proc/%d/syscall" % pid) as f:
        first = f.read().split()[0]
    return int(first) if first.lstrip("-").isdigit() else None


def await_blocked(pid: int, nr: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while blocked_in(pid) != nr:
        assert time.monotonic() < deadline, "pid %d never blocked in system call %d" % (pid, nr)
        time.sleep(0.01)


def state(pid: int) -> str:
    with open("/proc/%d/stat" % pid) as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2 :].split()[0]


def finish(proc: subprocess.Popen, data: str = "") -> str:
    out, _ = proc.communicate(data, timeout=30)
    assert proc.returncode == 0, out
    return out.strip()


def perm_of(line: str) -> int:
    return int(line.rsplit("perm", 1)[1])


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


@needs_tiles
@pytest.mark.parametrize("mode", ["read", "poll", "select"])
def test_a_running_process_blocked_in_a_call_gets_the_tiles_and_its_call_goes_on(procs, mode):
    proc = start(mode)
    procs.append(proc)
    assert xstate_perm.request_tiles(proc.pid) == 0
    if mode != "select":
        # Still waiting in the very call: made again (a poll with a timeout through
        # restart_syscall, for the time it had left), not ended.
        time.sleep(0.2)
        assert proc.poll() is None and blocked_in(proc.pid) == {"read": 0, "poll": 219}[mode]
    said = finish(proc, "hello\n")
    if mode == "select":
        words = said.split()
        assert words[:4] == ["select", "0", "errno", "0"] and float(words[5]) >= 1.9, said  # slept its full two seconds
    else:
        assert "read 6 'hello\\n' errno 0" in said and "-1" not in said, said
    assert perm_of(said) & TILES, said


@needs_tiles
def test_a_sleep_interrupted_sleeps_out_the_time_it_had_left(procs):
    proc = start("sleep")
    procs.append(proc)
    time.sleep(0.3)
    assert xstate_perm.request_tiles(proc.pid) == 0
    words = finish(proc).split()
    assert words[:4] == ["sleep", "0", "errno", "0"] and 1.9 <= float(words[5]) < 10, words
    assert perm_of(" ".join(words)) & TILES


@needs_tiles
def test_every_thread_of_the_process_holds_the_permission_and_the_others_never_stopped(procs):
    proc = start("threads")
    procs.append(proc)
    assert xstate_perm.request_tiles(proc.pid) == 0
    time.sleep(0.1)
    said = finish(proc, "hello\n")
    assert "read 6 'hello\\n' errno 0" in said, said
    assert int(said.split("thread perm")[1].split()[0]) & TILES and perm_of(said) & TILES, said
    assert int(said.split("ticks")[1].split()[0]) > 10, said


@needs_tiles
def test_a_stopped_process_gets_the_tiles_and_stays_stopped_until_continued(procs):
    proc = start("read")
    procs.append(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while state(proc.pid) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert xstate_perm.request_tiles(proc.pid) == 0
    assert proc.stdin is not None
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    time.sleep(0.3)
    assert state(proc.pid) == "T" and proc.poll() is None  # back in its stop: the data waits
    os.kill(proc.pid, signal.SIGCONT)
    said = finish(proc)
    assert "read 6 'hello\\n' errno 0" in said and perm_of(said) & TILES, said


@needs_tiles
def test_a_signal_arriving_while_it_asks_is_delivered_afterwards(procs):
    # The stop signal is sent just before the injection: it lands while the process is traced,
    # is held back and sent again, so the process ends up stopped as its sender meant.
    proc = start("read")
    procs.append(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    assert xstate_perm.request_tiles(proc.pid) == 0
    deadline = time.monotonic() + 10
    while state(proc.pid) != "T":
        assert time.monotonic() < deadline, state(proc.pid)
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGCONT)
    said = finish(proc, "hello\n")
    assert "read 6 'hello\\n' errno 0" in said and perm_of(said) & TILES, said


@needs_tiles
def test_every_process_of_a_tree_is_given_the_tiles_back(procs):
    proc = start("tree")
    procs.append(proc)
    deadline = time.monotonic() + 10
    while not any(blocked_in(int(c)) == 0 for c in open("/proc/%d/task/%d/children" % (proc.pid, proc.pid)).read().split()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    details: dict = {}
    assert xstate_perm.give_back_tiles(proc.pid, unit_name="test", details=details) == {"processes": 2, "refused": 0}
    assert details["amx_permission"] == {"processes": 2, "refused": 0}
    lines = finish(proc, "hello\n").splitlines()
    child = next(l for l in lines if l.startswith("child"))
    parent = next(l for l in lines if l.startswith("parent"))
    assert "read 6 'hello\\n' errno 0" in child and perm_of(child) & TILES and perm_of(parent) & TILES, lines


def regs(rip: int, rax: int, orig_rax: int) -> ctypes.Array:
    r = _Regs()
    r[_RIP], r[_RAX], r[_ORIG_RAX] = rip, rax % 2**64, orig_rax % 2**64
    return r


@pytest.mark.parametrize("code", [512, 513, 514])
def test_a_call_interrupted_to_be_restarted_is_put_back_as_that_call_about_to_be_made(code):
    out = xstate_perm.resumable(regs(0x1002, -code, 0))
    assert (out[_RIP], out[_RAX], out[_ORIG_RAX]) == (0x1000, 0, _NO_SYSCALL)


def test_a_call_interrupted_with_a_restart_block_is_put_back_as_restart_syscall():
    out = xstate_perm.resumable(regs(0x1002, -_ERESTART_RESTARTBLOCK, 35))
    assert (out[_RIP], out[_RAX], out[_ORIG_RAX]) == (0x1000, 219, _NO_SYSCALL)


@pytest.mark.parametrize(("rax", "orig_rax"), [(-4, 7), (6, 0), (-512, -1), (12345, -1)], ids=["eintr", "finished", "not-a-call", "user-code"])
def test_registers_of_no_call_to_restart_are_put_back_as_they_were(rax, orig_rax):
    out = xstate_perm.resumable(regs(0x1002, rax, orig_rax))
    assert (out[_RIP], out[_RAX], out[_ORIG_RAX]) == (0x1002, rax % 2**64, _NO_SYSCALL)


def test_nothing_is_done_where_the_host_offers_no_tiles(monkeypatch):
    monkeypatch.setattr(xstate_perm, "tiles_supported", lambda: False)
    monkeypatch.setattr(xstate_perm, "request_tiles", lambda pid: pytest.fail("asked without tiles"))
    details: dict = {}
    assert xstate_perm.give_back_tiles(os.getpid(), unit_name="test", details=details) is None
    assert details == {}


def test_a_process_that_cannot_be_made_to_ask_is_counted_and_warned_about_never_raised(monkeypatch, procs, caplog):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    procs.append(proc)
    monkeypatch.setattr(xstate_perm, "tiles_supported", lambda: True)

    def cannot(pid: int) -> int:
        raise OSError(1, "ptrace: Operation not permitted")

    with caplog.at_level(logging.WARNING, logger=xstate_perm.__name__):
        monkeypatch.setattr(xstate_perm, "request_tiles", cannot)
        assert xstate_perm.give_back_tiles(proc.pid, unit_name="solo") == {"processes": 1, "refused": 1}
        monkeypatch.setattr(xstate_perm, "request_tiles", lambda pid: -28)  # ENOSPC: a signal stack too small for the tiles
        assert xstate_perm.give_back_tiles(proc.pid, unit_name="solo") == {"processes": 1, "refused": 1}
        assert xstate_perm.give_back_tiles(2**22 + 1, unit_name="solo") == {"processes": 0, "refused": 0}  # no such process
        assert xstate_perm.give_back_tiles(0, unit_name="solo") == {"processes": 0, "refused": 0}  # not every process on the host
        proc.kill()
        deadline = time.monotonic() + 10
        while xstate_perm._state(proc.pid, proc.pid) != "Z":  # exited, not yet reaped: nothing to ask
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(xstate_perm, "request_tiles", cannot)
        assert xstate_perm.give_back_tiles(proc.pid, unit_name="solo") == {"processes": 0, "refused": 0}
    assert "unit solo: pid %d could not be made to ask" % proc.pid in caplog.text
    assert "unit solo: pid %d was refused its AMX permission: No space left on device" % proc.pid in caplog.text


def given_back(details: dict, processes: int = 2) -> None:
    """What a restore says it did: every process asked where the host has tiles, nothing else."""
    if xstate_perm.tiles_supported():
        tiles = details["amx_permission"]
        assert tiles["processes"] >= processes and tiles["refused"] == 0, details
    else:
        assert "amx_permission" not in details, details


@pytest.mark.parametrize("memory", ["filled", "on-demand", "copied"])
@pytest.mark.parametrize("own_namespaces", [False, True], ids=["host-namespaces", "own-namespaces"])
def test_every_restore_path_gives_the_processes_their_tiles_back_before_any_runs_and_they_run_on(criu, tmp_path, monkeypatch, memory, own_namespaces):
    """Filled, on demand or copied by CRIU: CRIU leaves the tree stopped, every thread of it is
    in its stop when it is asked, and it runs on once continued."""
    filled, lazy = memory == "filled", memory == "on-demand"
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    if filled:
        assert page_fill.split_for_fill(images).bytes_moved > 0
    asked_while: list[bool] = []
    ask = xstate_perm.give_back_tiles

    def ask_stopped(root_pid, **kw):
        asked_while.append(all(page_fill.threads_stopped(p) for p in tree_pids(root_pid)))
        return ask(root_pid, **kw)

    monkeypatch.setattr(xstate_perm, "give_back_tiles", ask_stopped)
    measured: dict = {}
    with settings.using(settings.current().replace(lazy_pages=lazy)):
        if own_namespaces:
            restored = CpuDriver().restore(image, images, log_path=tmp_path / "restore.log", progress=lambda m: None)
            pid, measured = restored.root_pid, restored.details
        else:
            pid, _ = criu_tree.restore(Criu.locate(), image, images, log_path=tmp_path / "restore.log", progress=lambda m: None, lazy=lazy, details=measured)
    try:
        assert ("page_fill" in measured) == filled, measured
        assert asked_while == [True], "the tree ran before its processes were asked"
        given_back(measured)
        # The parent waits in its server's poll, the child in a read of a pipe: both answer.
        assert digest(port) == before
    finally:
        kill_tree(pid)


def test_a_unit_dumped_stopped_at_a_cut_is_given_its_tiles_back_and_left_stopped(criu, tmp_path):
    """Units of a workload on several hosts are stopped for the cut and dumped so: they come
    back stopped (CRIU restores the stop), and stay so until the coordinator continues every
    one at once."""
    images, image, port, before = dump_pattern(tmp_path, PAGES, stopped=True)
    peer = image.model_copy(update={"driver_data": DriverData(peer_connections=True)})
    measured: dict = {}
    pid, _ = criu_tree.restore(Criu.locate(), peer, images, log_path=tmp_path / "restore.log", progress=lambda m: None, details=measured)
    try:
        given_back(measured)
        continues_as_dumped(pid, port, before)
    finally:
        kill_tree(pid)
