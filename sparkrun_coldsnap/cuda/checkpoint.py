"""The CUDA driver's process checkpoint API around a CRIU dump, in the right order.

Capture: lock every CUDA process of the workload before checkpointing any
(a process left running could talk to one already frozen), then checkpoint
each (device memory moves to host memory, device fds close). Restore:
restore every process before unlocking any. A failure part-way rolls back so
the workload is left running, or reports exactly which process is stuck.

The calls go through a long-lived helper process (``cuda/helper.py``) that
runs in a Python with ``cuda-bindings``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import psutil

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import CaptureError, RestoreError, ToolError
from sparkrun_coldsnap.host.process_tree import fd_targets, mapped_paths

HELPER = Path(__file__).with_name("helper.py")
LOCK_TIMEOUT_MS = 30_000
#: How long the helper may take to answer one call, beyond a lock's own timeout. A call on a
#: process that shares device memory with a locked peer (CUDA IPC, as NCCL's P2P transport
#: and custom all-reduce kernels use) does not fail: it blocks until that peer is unlocked
#: (NVIDIA/cuda-checkpoint#30), so without a deadline a capture would wait forever.
CALL_SECONDS = {"checkpoint": 900.0, "restore": 900.0, "restore_many": 1800.0, "init": 120.0}
OTHER_CALL_SECONDS = 60.0


class CheckpointApi(Protocol):
    def state(self, pid: int) -> str: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, pairs: Sequence[tuple[str, str]]) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def uuids(self) -> list[str]: ...

    def files(self) -> list[str]:
        """The files the helper has loaded (its modules and libraries, CUDA's among them)."""
        ...

    def restore_many(self, pids: Sequence[int], pairs: Sequence[tuple[str, str]], *, parallel: bool) -> dict[int, float]:
        """Restore every process, then unlock every one (each step on all of them at once when
        *parallel*); the seconds each process took. A failure raises ``CudaCallError`` with
        ``pid`` and ``op`` set, and unlocks none."""
        ...


class CudaCallError(RuntimeError):
    """One checkpoint API call failed; ``str()`` is the CUDA error name. On a call over several
    processes, ``pid`` and ``op`` say which process and which step."""

    def __init__(self, message: str, *, pid: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.pid, self.op = pid, op


class CudaCallHung(CudaCallError):
    """The driver did not answer a call in time; the helper that made it was killed."""


class HelperProcess:
    """CheckpointApi over the helper's JSON-lines protocol.

    Starting returns at once: the helper initializes CUDA (seconds) while the caller
    goes on, and the first call waits for it. A restore starts it before CRIU runs,
    or earlier still, during preparation.
    """

    def __init__(self, python: str | None = None, *, slack: float = 1.0) -> None:
        python = python or helper_python()
        #: scales every call's deadline (tests use short ones)
        self.slack = slack
        self._python = python
        self._start(python)

    def _start(self, python: str) -> None:
        # It must see every GPU, whatever the plugin was started with: the driver checks the
        # captured UUIDs against the caller's, and a restore may move the workload.
        env = {k: v for k, v in settings.current().environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        try:
            self.proc = subprocess.Popen([python, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        except FileNotFoundError as err:
            raise ToolError("cannot start the CUDA checkpoint helper: %s not found" % python) from err
        self._send({"op": "init"})
        self._driver_version: int | None = None

    def restart(self) -> None:
        """A fresh helper in place of one that was killed (a call it made hung)."""
        self.kill()
        self._start(self._python)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def driver_version(self) -> int:
        if self._driver_version is None:
            self._driver_version = int(self._receive("init")["driver"])
        return self._driver_version

    def _send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _call(self, msg: dict) -> dict:
        _ = self.driver_version  # the init reply comes first
        self._send(msg)
        return self._receive(msg["op"], msg.get("timeout_ms", 0) / 1000, msg.get("pid"))

    def _receive(self, op: str, extra: float = 0.0, pid: int | None = None) -> dict:
        assert self.proc.stdout is not None
        limit = (CALL_SECONDS.get(op, OTHER_CALL_SECONDS) + extra) * self.slack
        # One answer line per call; the pipe is line-buffered on the helper's side.
        ready, _, _ = select.select([self.proc.stdout], [], [], limit)
        if not ready:
            self.kill()  # the call may still be pending in the driver: this helper is done
            raise CudaCallHung("no answer to %s%s within %.0f s" % (op, " of process %d" % pid if pid else "", limit))
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise ToolError("the CUDA checkpoint helper exited: %s" % (err.strip().splitlines() or ["no output"])[-1])
        out = json.loads(line)
        if not out.get("ok"):
            raise CudaCallError(out.get("error") or "unknown error", pid=out.get("pid"), op=out.get("op"))
        return out

    def state(self, pid: int) -> str:
        return self._call({"op": "state", "pid": pid})["state"]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call({"op": "lock", "pid": pid, "timeout_ms": timeout_ms})

    def checkpoint(self, pid: int) -> None:
        self._call({"op": "checkpoint", "pid": pid})

    def restore(self, pid: int, pairs: Sequence[tuple[str, str]]) -> None:
        self._call({"op": "restore", "pid": pid, "pairs": [list(p) for p in pairs]})

    def unlock(self, pid: int) -> None:
        self._call({"op": "unlock", "pid": pid})

    def uuids(self) -> list[str]:
        return list(self._call({"op": "uuids"})["uuids"])

    def files(self) -> list[str]:
        # Its modules as it names them, and what it maps (the interpreter, the bindings' and
        # CUDA's libraries) as this side reads it: the files a restore should find in memory.
        found = set(self._call({"op": "modules"})["files"]) | mapped_paths(self.proc.pid)
        return sorted({os.path.realpath(f) for f in found if os.path.isfile(f)})

    def restore_many(self, pids: Sequence[int], pairs: Sequence[tuple[str, str]], *, parallel: bool) -> dict[int, float]:
        answer = self._call({"op": "restore_many", "pids": list(pids), "pairs": [list(p) for p in pairs], "parallel": parallel})
        return {int(pid): float(s) for pid, s in answer["seconds"].items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})  # no answer comes: the helper just ends
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """End it at once, initialized or not."""
        self.proc.kill()
        self.proc.wait()


def helper_python() -> str:
    """The interpreter for the helper: COLDSNAP_CUDA_PYTHON, else this one."""
    return settings.current().cuda_python or sys.executable


def cuda_processes(pids: Sequence[int]) -> list[int]:
    """Those of *pids* that hold NVIDIA device files open (each has a CUDA context).

    A descriptor the process closes while this reads its table is skipped on its own: the
    process's other descriptors still count."""
    return [pid for pid in pids if any(t.startswith("/dev/nvidia") for _, t in fd_targets(pid))]


def _name(pid: int) -> str:
    try:
        return "%d (%s)" % (pid, psutil.Process(pid).name())
    except psutil.Error:
        return str(pid)


def checkpoint_all(api: CheckpointApi, pids: Sequence[int], *, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
    """Lock all, then checkpoint all; on failure put every process back to running."""
    lock_all(api, pids, timeout_ms=timeout_ms)
    checkpoint_locked(api, pids)


def lock_all(api: CheckpointApi, pids: Sequence[int], *, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
    """Lock every process of *pids*; on failure every one is put back to running first.

    The first half of :func:`checkpoint_all`; a cut across hosts locks every host's
    processes before any host checkpoints (``controller/cut.py``)."""
    locked: list[int] = []
    try:
        for pid in pids:
            try:
                api.lock(pid, timeout_ms)
            except CudaCallError as err:
                raise CaptureError(
                    "cannot lock CUDA process %s within %d ms (%s): is it stuck in a kernel or a collective, or does it share device memory with a process already locked? the workload was left running" % (_name(pid), timeout_ms, err)
                ) from err
            locked.append(pid)
    except CaptureError as err:
        _roll_back(err, api, pids, locked=locked, checkpointed=[])
        raise


def checkpoint_locked(api: CheckpointApi, pids: Sequence[int]) -> None:
    """Checkpoint every process of *pids*, all locked already; on failure every one is put
    back to running (restored where it was checkpointed, then unlocked) first."""
    done: list[int] = []
    try:
        for pid in pids:
            try:
                api.checkpoint(pid)
            except CudaCallError as err:
                raise CaptureError("CUDA checkpoint of process %s failed (%s); the workload was left running" % (_name(pid), err)) from err
            done.append(pid)
    except CaptureError as err:
        _roll_back(err, api, pids, locked=pids, checkpointed=done)
        raise


def _roll_back(err: CaptureError, api: CheckpointApi, pids: Sequence[int], *, locked: Sequence[int], checkpointed: Sequence[int]) -> None:
    problems = resume_all(api, pids, locked=locked, checkpointed=checkpointed)
    if problems:
        err.args = ("%s; rolling back also failed: %s" % (err, "; ".join(problems)),)


@runtime_checkable
class Restartable(Protocol):
    """A checkpoint API whose calls may hang (the helper): it can be replaced by a fresh one."""

    @property
    def alive(self) -> bool: ...
    def restart(self) -> None: ...


def _usable(api: CheckpointApi) -> CheckpointApi:
    if isinstance(api, Restartable) and not api.alive:
        api.restart()
    return api


def resume_all(api: CheckpointApi, pids: Sequence[int], *, locked: Sequence[int], checkpointed: Sequence[int]) -> list[str]:
    """Every process of *pids* back to running; what could not be, one line each.

    The processes known to be locked and checkpointed go first, in the restore order
    (restore each, then unlock each): a call blocked behind a locked peer then goes
    through. Every other process is settled by the state the driver reports, since a
    call that hung may have been carried out after all."""
    problems: list[str] = []
    for pid in checkpointed:
        problems += _step(api, "restore", pid)
    for pid in locked:
        problems += _step(api, "unlock", pid)
    for pid in pids:
        if pid in locked:
            continue
        try:
            state = _usable(api).state(pid)
        except CudaCallError as err:
            problems.append("state of %s: %s" % (_name(pid), err))
            continue
        if state == "checkpointed":
            problems += _step(api, "restore", pid)
            state = "locked"
        if state == "locked":
            problems += _step(api, "unlock", pid)
        elif state != "running":
            problems.append("process %s is %s" % (_name(pid), state))
    return problems


def _step(api: CheckpointApi, op: str, pid: int) -> list[str]:
    try:
        if op == "restore":
            _usable(api).restore(pid, ())
        else:
            _usable(api).unlock(pid)
    except CudaCallError as err:
        return ["%s %s: %s" % (op, _name(pid), err)]
    return []


def restore_all(api: CheckpointApi, pids: Sequence[int], pairs: Sequence[tuple[str, str]] = ()) -> dict[int, float]:
    """Restore all, then unlock all; the seconds each process took. The processes go side by
    side (``COLDSNAP_CUDA_RESTORE``: each restore is carried out by its own process, so the
    API server's context and the engine's come back together) unless the settings say
    serial. A failure leaves the tree unusable: the caller stops it."""
    try:
        return api.restore_many(pids, pairs, parallel=settings.current().cuda_restore_parallel and len(pids) > 1)
    except CudaCallError as err:
        pid = err.pid if err.pid is not None else (pids[0] if pids else 0)
        raise RestoreError("CUDA %s of process %s failed (%s, state %s)" % (err.op or "restore", _name(pid), err, _state(api, pid))) from err


def restore_each(api: CheckpointApi, pids: Sequence[int], pairs: Sequence[tuple[str, str]] = ()) -> None:
    """Every process back on its GPU, still locked: the first half of a restore across hosts,
    which unlocks no host's processes before every host restored its own (one host's tree
    goes through :func:`restore_all`)."""
    for pid in pids:
        try:
            api.restore(pid, pairs)
        except CudaCallError as err:
            raise RestoreError("CUDA restore of process %s failed (%s, state %s)" % (_name(pid), err, _state(api, pid))) from err


def unlock_each(api: CheckpointApi, pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            api.unlock(pid)
        except CudaCallError as err:
            raise RestoreError("CUDA unlock of process %s failed (%s, state %s)" % (_name(pid), err, _state(api, pid))) from err


def _state(api: CheckpointApi, pid: int) -> str:
    try:
        return _usable(api).state(pid)
    except CudaCallError as err:
        return "unknown: %s" % err


def visible_uuids(spec: str | None, uuids: Sequence[str]) -> list[str]:
    """The GPUs a process sees under ``CUDA_VISIBLE_DEVICES=spec``, as CUDA reads it.

    Entries are indices or (prefixes of) UUIDs; like CUDA, the list ends at the first
    entry that names no GPU. ``uuids`` is every GPU in CUDA's order.
    """
    if spec is None:
        return list(uuids)
    out: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        if item.isdigit():
            if int(item) >= len(uuids):
                break
            out.append(uuids[int(item)])
            continue
        named = [u for u in uuids if item and (u.startswith((item, "GPU-" + item)))]
        if len(named) != 1:
            break
        out.append(named[0])
    return out


def workload_gpus(visible: Sequence[str], held: Sequence[str]) -> list[str]:
    """The GPUs a workload uses: those it sees and holds memory on, in the order it sees
    them. A process that sees two GPUs but works on one (vLLM without CUDA_VISIBLE_DEVICES
    on a two-GPU host) uses one, and may come back on either. All it sees when the driver
    reports nothing."""
    used = [u for u in visible if u in set(held)]
    return used or list(visible)


def gpu_pairs(used: Sequence[str], captured_all: Sequence[str], here_all: Sequence[str], targets: Sequence[str]) -> list[tuple[str, str]]:
    """The GPU remapping for a restore: the workload's GPUs onto ``targets``, the rest onto the rest.

    The driver refuses a remapping (CUDA_ERROR_INVALID_VALUE) that does not name every GPU
    of the capture host, even those the process's CUDA_VISIBLE_DEVICES hid, so the pairs
    are a whole one-to-one mapping of that host's GPUs onto this one's. ``targets`` is what
    this side's CUDA_VISIBLE_DEVICES shows, in its order; no pairs when nothing moves.
    """
    if len(targets) < len(used):
        raise RestoreError("the capsule's workload used %d GPUs but only %d are visible here (CUDA_VISIBLE_DEVICES=%s): make as many visible" % (len(used), len(targets), settings.current().cuda_visible_devices or "unset"))
    if len(here_all) < len(captured_all):
        raise RestoreError("the capsule was captured on a host with %d GPUs and this one has %d: restore it on a host with as many" % (len(captured_all), len(here_all)))
    chosen = list(targets[: len(used)])
    pairs = list(zip(used, chosen))
    rest_old = [u for u in captured_all if u not in used]
    rest_new = [u for u in here_all if u not in chosen]
    pairs += list(zip(rest_old, rest_new))
    if all(old == new for old, new in pairs):
        return []
    return pairs
