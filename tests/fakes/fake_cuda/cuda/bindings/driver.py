"""FAKE ``cuda.bindings.driver`` (tests only): the CUDA driver's process checkpoint API, no GPU.

CI has no GPU, so ``cuda/helper.py`` imports this module instead of NVIDIA's
bindings when ``tests/fakes/fake_cuda`` is first on its ``PYTHONPATH``. It offers the
calls and types the helper uses, with cuda-bindings' calling convention (every call
returns a tuple whose first item is a ``CUresult``), and it enforces what the driver
documents and what was measured on the GPU machine:

* nothing but ``cuDriverGetVersion`` works before ``cuInit`` (CUDA_ERROR_NOT_INITIALIZED);
* the states RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock->
  RUNNING; any other call is CUDA_ERROR_ILLEGAL_STATE;
* a lock takes the process's locks at once (its next kernel waits) and then waits for the
  kernel in flight; past ``timeoutMs`` (0: no limit) it lets go and answers
  CUDA_ERROR_TIMEOUT, the process still RUNNING;
* a checkpoint makes the process release its device files (CRIU cannot dump them); a
  restore makes it open them again, on the GPU its pairs name;
* a restore's GPU pairs must name every GPU of the host the process was checkpointed on
  (not only those it used), each onto a distinct GPU of this host of the same chip, else
  CUDA_ERROR_INVALID_VALUE and nothing changes; without pairs its GPUs must be here;
* a process that cannot give up or get back its device (a GPU gone from the bus) goes to
  FAILED, from which no call moves it;
* a process sharing device memory with another (CUDA IPC) does not answer a call while
  that peer is locked or checkpointed (NVIDIA/cuda-checkpoint#30: it waits until the peer
  is unlocked, with no error and no timeout), and its checkpoint does not complete while
  that peer runs (#45): such a tree cannot be checkpointed before driver 610;
* a process checkpointed while it holds a collective communicator (NCCL's; in the fakes, the
  ring that stands for it) is restored and unlocked with success, and every kernel it runs
  afterwards fails with "CUDA error: unspecified launch failure" (measured on driver
  580.159.04 with NCCL 2.28.9: docs/gpu-ranks.md, "Two hosts through sparkrun on one GPU"); a
  process holds one between ``FakeCudaContext.hold_communicator(True)`` and ``(False)``.

The rules are carried out by the process side, ``fake_cuda_process.py``, where the state
lives; the calls reach it through ``fake_gpu_state.py``.
"""

from __future__ import annotations

import ctypes
import enum
import os
import secrets
import time
import uuid as uuidlib

import fake_gpu_state as gpu


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_TIMEOUT = 909
    CUDA_ERROR_UNKNOWN = 999


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


STATES = {"running": 0, "locked": 1, "checkpointed": 2, "failed": 3}
DRIVER_VERSION = 13000
#: how long a call waits for the process to carry it out (a lock: plus its timeout)
HANDOVER_SECONDS = 10.0

_initialized = False


class CUuuid:
    """16 bytes at an address; ``bytes`` reads them (cuda-bindings exposes them read-only)."""

    def __init__(self) -> None:
        self._raw = (ctypes.c_char * 16)()

    def getPtr(self) -> int:
        return ctypes.addressof(self._raw)

    @property
    def bytes(self) -> bytes:
        return bytes(self._raw)


class CUcheckpointLockArgs:
    def __init__(self) -> None:
        self.timeoutMs = 0


class CUcheckpointGpuPair:
    def __init__(self) -> None:
        self.oldUuid = CUuuid()
        self.newUuid = CUuuid()


class CUcheckpointRestoreArgs:
    def __init__(self) -> None:
        self.gpuPairs: list[CUcheckpointGpuPair] = []
        self.gpuPairsCount = 0


def _ok(*values):
    return (CUresult.CUDA_SUCCESS, *values)


def _err(code: CUresult, *fill):
    return (code, *fill)


def cuInit(flags: int):
    global _initialized
    if flags != 0:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    _initialized = True
    return _ok()


def cuDriverGetVersion():
    return _ok(DRIVER_VERSION)


def cuDeviceGetCount():
    if not _initialized:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)
    return _ok(len(gpu.gpus()))


def cuDeviceGet(ordinal: int):
    if not _initialized:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)
    if not 0 <= ordinal < len(gpu.gpus()):
        return _err(CUresult.CUDA_ERROR_INVALID_DEVICE, 0)
    return _ok(ordinal)


def cuDeviceGetUuid(dev: int):
    if not _initialized:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
    u = CUuuid()
    ctypes.memmove(u.getPtr(), uuidlib.UUID(gpu.gpus()[int(dev)]["uuid"].removeprefix("GPU-")).bytes, 16)
    return _ok(u)


def _uuid_text(u: CUuuid) -> str:
    return "GPU-" + str(uuidlib.UUID(bytes=u.bytes))


def _call(pid: int, op: str, **args) -> tuple[CUresult, str | None]:
    """Carry out *op* on the CUDA process *pid* (its own thread does, as libcuda does): (result, its state)."""
    if not _initialized:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED, None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return CUresult.CUDA_ERROR_NOT_FOUND, None
    if gpu.read_proc(pid) is None:
        return CUresult.CUDA_ERROR_NOT_FOUND, None  # never had a CUDA context
    rid = secrets.token_hex(8)
    gpu.write_json(gpu.request_path(pid), {"id": rid, "op": op, **args})
    deadline = time.monotonic() + HANDOVER_SECONDS + args.get("timeout_ms", 0) / 1000
    while time.monotonic() < deadline:
        ans = gpu.read_json(gpu.answer_path(pid))
        if ans is not None and ans["id"] == rid:
            return CUresult[ans["result"]], ans["state"]
        time.sleep(0.005)
    return CUresult.CUDA_ERROR_UNKNOWN, None


def cuCheckpointProcessGetState(pid: int):
    code, state = _call(pid, "state")
    if state is None:
        return _err(code, None)
    return _ok(CUprocessState(STATES[state]))


def cuCheckpointProcessLock(pid: int, args: CUcheckpointLockArgs | None):
    return (_call(pid, "lock", timeout_ms=int(args.timeoutMs) if args is not None else 0)[0],)


def cuCheckpointProcessCheckpoint(pid: int, args: object | None):
    return (_call(pid, "checkpoint")[0],)


def cuCheckpointProcessRestore(pid: int, args: CUcheckpointRestoreArgs | None):
    pairs = []
    if args is not None and args.gpuPairsCount:
        if len(args.gpuPairs) != args.gpuPairsCount:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
        pairs = [[_uuid_text(p.oldUuid), _uuid_text(p.newUuid)] for p in args.gpuPairs]
    return (_call(pid, "restore", pairs=pairs)[0],)


def cuCheckpointProcessUnlock(pid: int, args: object | None):
    return (_call(pid, "unlock")[0],)
