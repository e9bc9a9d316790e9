"""AMX tile permission given back to processes CRIU restored.

On x86 a process may use AMX tiles (Intel's matrix unit) only once it asked the kernel for
the tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). The permission
belongs to the process, a fork inherits it and an exec drops it. CRIU saves none of it:
``criu`` is exec'd, so every process it restores comes back without it, while the libraries
that asked before the dump (oneDNN, torch, vLLM's CPU kernels) remember that they did and use
the tiles again; the first tile instruction after the restore then ends the process with
SIGILL (the CPU vLLM's worker "died unexpectedly (exit code: -4)" at its first request).

So each process of a restored tree is made to ask again, before the workload is sent a
request: seized with ptrace, interrupted, made to run that one system call from a
``syscall`` instruction of its vDSO, its registers put back, and let go. A tree CRIU left
stopped goes back into its stop; a running one runs on. The permission is the whole
process's, so one thread of each process is enough; the others never stop.

A running thread is often blocked in a system call (a read, a poll, a sleep) when it is
interrupted; the kernel then has it return ``-ERESTART*`` and would restart the call on the
way back to user space, but only when the thread leaves a signal stop, not when a tracer puts
its registers back at the end of another system call. So the registers put back are those of
the restarted call, as CRIU's dump records them: the instruction pointer back on the
``syscall`` instruction and the call's number in ``rax``. Calls the kernel never restarts
(``epoll_wait``, ``sigtimedwait``) return ``EINTR`` as they do when a dump seizes the tree.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import signal
from typing import Any

from sparkrun_coldsnap.host.process_tree import tree_pids

log = logging.getLogger(__name__)

_ARCH_PRCTL = 158  # __NR_arch_prctl on x86_64
_RESTART_SYSCALL = 219  # __NR_restart_syscall on x86_64
_TGKILL = 234  # __NR_tgkill on x86_64
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_PTRACE_GETREGS, _PTRACE_SETREGS, _PTRACE_SYSCALL, _PTRACE_DETACH = 12, 13, 24, 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_PTRACE_NAMES = {12: "GETREGS", 13: "SETREGS", 24: "SYSCALL", 17: "DETACH", 0x4206: "SEIZE", 0x4207: "INTERRUPT"}
_PTRACE_O_TRACESYSGOOD = 1
_WALL = 0x40000000
# What an interrupted system call returns so that the kernel restarts it: ERESTARTSYS,
# ERESTARTNOINTR and ERESTARTNOHAND mean the same call again, ERESTART_RESTARTBLOCK the
# restart_syscall call that resumes it (a sleep, for the time still left).
_ERESTART_SAME = (512, 513, 514)
_ERESTART_RESTARTBLOCK = 516
_SYSCALL_INSN = b"\x0f\x05"
# struct user_regs_struct (x86_64): the fields used here
_RAX, _RSI, _RDI, _ORIG_RAX, _RIP = 10, 13, 14, 15, 16
_Regs = ctypes.c_ulonglong * 27
_NO_SYSCALL = 2**64 - 1  # orig_rax -1: no system call for the kernel to restart
#: stops one injection may go through: the interrupt, group stops reported again, signals
#: arriving meanwhile, then the system call's entry and exit
_MOST_STOPS = 64
#: the most of an executable mapping read looking for a ``syscall`` instruction
_SCAN_BYTES = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long


class _Ended(OSError):
    """The process ended while it was being made to ask."""


@functools.cache
def tiles_supported() -> bool:
    """Whether this host's kernel offers AMX tile data to processes that ask (x86_64 only)."""
    if platform.machine() != "x86_64":
        return False
    mask = ctypes.c_ulonglong(0)
    return _libc.syscall(_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) == 0 and bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def give_back_tiles(root_pid: int, *, unit_name: str, details: dict[str, Any] | None = None) -> dict[str, int] | None:
    """Make every process of the restored tree at *root_pid* ask again for the AMX tiles CRIU
    restored it without; call it before the workload is sent anything, and on a tree left
    stopped before it is continued.

    Returns how many processes were asked (those that have exited are not) and how many were
    refused or could not be made to ask (each with a warning: such a process fails only if it
    uses the tiles), and puts the same in ``details["amx_permission"]``; None, and nothing
    done, where the host offers no tiles. Never raises: a restore is not failed for a process
    that may never use them."""
    if not tiles_supported():
        return None
    try:
        # Pid 0 (what docker reports for a container that is not running) is no tree: its
        # children are the host's init and the kernel's threads.
        pids = tree_pids(root_pid) if root_pid > 1 else []
    except Exception as err:
        log.warning("unit %s: the processes of the tree at pid %d could not be listed to give them back their AMX permission: %s", unit_name, root_pid, err)
        pids = []
    else:
        if not pids:
            log.warning("unit %s: no process at pid %d to give back its AMX permission", unit_name, root_pid)
    asked = refused = 0
    for pid in pids:
        try:
            rc = request_tiles(pid)
        except Exception as err:
            if _ended(pid):  # a process that has exited (a zombie not yet reaped) needs nothing
                continue
            log.warning("unit %s: pid %d could not be made to ask again for its AMX permission: %s", unit_name, pid, err)
            asked += 1
            refused += 1
            continue
        asked += 1
        if rc != 0:
            log.warning("unit %s: pid %d was refused its AMX permission: %s", unit_name, pid, os.strerror(-rc))
            refused += 1
    out = {"processes": asked, "refused": refused}
    if details is not None:
        details["amx_permission"] = out
    return out


def request_tiles(pid: int) -> int:
    """Make process *pid*, stopped or running, ask for AMX tile data; returns what the call
    returned (0, or a negative errno).

    A stopped process is left in its stop; a running one runs on, a system call it was
    blocked in restarted. Signals that arrive meanwhile are held back and sent again once it
    is let go."""
    tid = _live_thread(pid)
    _ptrace(_PTRACE_SEIZE, tid, 0, _PTRACE_O_TRACESYSGOOD)
    held: list[int] = []
    try:
        return _inject(tid, held)
    finally:
        _detach(tid)
        for sig in held:
            _libc.syscall(_TGKILL, pid, tid, sig)


def _inject(tid: int, held: list[int]) -> int:
    saved = _Regs()
    _ptrace(_PTRACE_INTERRUPT, tid)
    _signal_held(_stopped(tid), held)
    _ptrace(_PTRACE_GETREGS, tid, 0, saved)
    back = resumable(saved)
    regs = _Regs(*saved)
    regs[_RIP], regs[_RAX], regs[_RDI], regs[_RSI] = _syscall_ip(tid), _ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA
    regs[_ORIG_RAX] = _NO_SYSCALL  # nothing for the kernel to restart on the way to the injected call
    changed = False
    try:
        _ptrace(_PTRACE_SETREGS, tid, 0, regs)
        changed = True
        syscall_stops = 0
        for _ in range(_MOST_STOPS):
            _ptrace(_PTRACE_SYSCALL, tid)
            status = _stopped(tid)
            if os.WSTOPSIG(status) == signal.SIGTRAP | 0x80:
                syscall_stops += 1
                if syscall_stops == 2:
                    break
            else:
                _signal_held(status, held)
        else:
            raise OSError("pid %d did not make the system call asking for its AMX permission" % tid)
        _ptrace(_PTRACE_GETREGS, tid, 0, regs)
        if regs[_ORIG_RAX] != _ARCH_PRCTL:
            raise OSError("pid %d stopped in system call %d, not in the one asking for its AMX permission" % (tid, regs[_ORIG_RAX]))
    except _Ended:
        changed = False  # nothing left to put back
        raise
    finally:
        if changed:
            _ptrace(_PTRACE_SETREGS, tid, 0, back)
    return ctypes.c_longlong(regs[_RAX]).value


def resumable(regs: ctypes.Array) -> ctypes.Array:
    """*regs*, taken at a ptrace stop, as they are to be put back at the exit of another system
    call: a call interrupted to be restarted becomes that call about to be made again.

    The kernel restarts it only on its way out of a signal stop; put back at a system call's
    exit the registers would hand ``-ERESTARTSYS`` (-512) to user space. CRIU's dump turns
    them the same way."""
    out = _Regs(*regs)
    nr = ctypes.c_longlong(regs[_ORIG_RAX]).value
    rc = ctypes.c_longlong(regs[_RAX]).value
    if nr >= 0 and -rc in (*_ERESTART_SAME, _ERESTART_RESTARTBLOCK):
        out[_RIP] = regs[_RIP] - len(_SYSCALL_INSN)
        out[_RAX] = nr if -rc in _ERESTART_SAME else _RESTART_SYSCALL
    out[_ORIG_RAX] = _NO_SYSCALL
    return out


def _signal_held(status: int, held: list[int]) -> None:
    """Hold back the signal a signal-delivery stop reports; other stops (the interrupt, a
    group stop: ``PTRACE_EVENT_STOP`` in the status's high bits) hold nothing."""
    if status >> 16 == 0 and os.WSTOPSIG(status) != signal.SIGTRAP | 0x80:
        held.append(os.WSTOPSIG(status))


def _live_thread(pid: int) -> int:
    """A thread of *pid* that can be seized: its main thread, unless that one has exited
    while others run on (a zombie cannot be traced)."""
    if _state(pid, pid) not in ("Z", "X"):
        return pid
    try:
        tids = sorted(int(t) for t in os.listdir("/proc/%d/task" % pid))
    except OSError:
        return pid
    return next((t for t in tids if _state(pid, t) not in ("Z", "X", "")), pid)


def _ended(pid: int) -> bool:
    return _state(pid, _live_thread(pid)) in ("Z", "X", "")


def _state(pid: int, tid: int) -> str:
    try:
        with open("/proc/%d/task/%d/stat" % (pid, tid)) as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


def _ptrace(request: int, pid: int, addr: int = 0, data: int | ctypes.Array | None = None) -> None:
    arg = ctypes.cast(data, ctypes.c_void_p) if isinstance(data, ctypes.Array) else data
    if _libc.ptrace(request, pid, addr, arg) == -1:
        err = ctypes.get_errno()
        raise OSError(err, "ptrace(PTRACE_%s) of pid %d: %s" % (_PTRACE_NAMES.get(request, request), pid, os.strerror(err)))


def _detach(tid: int) -> None:
    try:
        _ptrace(_PTRACE_DETACH, tid)  # a process stopped before goes back into its group stop
    except OSError as err:
        if err.errno != 3:  # ESRCH: it ended meanwhile
            raise


def _stopped(tid: int) -> int:
    _, status = os.waitpid(tid, _WALL)
    if not os.WIFSTOPPED(status):
        raise _Ended("pid %d ended while its AMX permission was being asked for" % tid)
    return status


def _syscall_ip(tid: int) -> int:
    """The address of a ``syscall`` instruction *tid* can execute: in its vDSO, else in the
    first executable mapping that has one (a process restored without a vDSO)."""
    areas: list[tuple[bool, int, int]] = []
    with open("/proc/%d/maps" % tid) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2 and "x" in fields[1]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                areas.append((line.rstrip().endswith("[vdso]"), start, end))
    areas.sort(key=lambda a: not a[0])
    with open("/proc/%d/mem" % tid, "rb", buffering=0) as mem:
        for _, start, end in areas:
            try:
                mem.seek(start)
                code = mem.read(min(end - start, _SCAN_BYTES))
            except OSError:
                continue
            at = code.find(_SYSCALL_INSN)
            if at >= 0:
                return start + at
    raise OSError("pid %d has no syscall instruction in an executable mapping" % tid)
