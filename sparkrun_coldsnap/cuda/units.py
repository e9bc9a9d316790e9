"""The CUDA processes of one unit of a workload on several hosts, one step at a time, on their host.

On one host the n610 driver locks, checkpoints and dumps in one call (``gpu_ranks.capture``),
and restores then unlocks in another. Across hosts the coordinator
(``controller/cut.py``) calls each
step on every unit before it calls the next step on any: every CUDA process of every host is
locked before any is checkpointed, every one is checkpointed before any tree is stopped and
dumped, and every host's processes have their GPUs back before any is unlocked. A rank left
running while its peer on another host is frozen could start a collective that waits on the
frozen one, and the lock of the running one would then never complete.

Each step is one call of the unit's agent on its host, so each starts a helper process of its
own and pays its CUDA initialization (about 2.5 s on the GPU machine); the functions here take
the checkpoint API as a parameter, so the order can be tested against a fake of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda import nvidia
from sparkrun_coldsnap.cuda.checkpoint import CheckpointApi, HelperProcess
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.errors import CaptureError, RequestError
from sparkrun_coldsnap.host.process_tree import tree_pids

#: what the coordinator may know of a unit's processes after a failed cut
STATES = ("locked", "checkpointed", "unknown")


def workload_gpus(api: CheckpointApi, root_pid: int, pids: Sequence[int]) -> tuple[list[str], list[str]]:
    """(the GPUs the tree uses: those its root's CUDA_VISIBLE_DEVICES shows and it holds memory
    on, every GPU of this host in CUDA's order), so a restore can put it back on those or remap
    it onto others."""
    every = api.uuids()
    visible = cuda_checkpoint.visible_uuids(psutil.Process(root_pid).environ().get("CUDA_VISIBLE_DEVICES"), every)
    return cuda_checkpoint.workload_gpus(visible, nvidia.gpus_of(pids)), every


def lock(api: HelperProcess, root_pid: int, *, timeout_ms: int = cuda_checkpoint.LOCK_TIMEOUT_MS) -> DriverData:
    """Lock every CUDA process of the tree; what a restore needs of them. On failure every
    process locked is unlocked again before the error goes on."""
    pids = tuple(tree_pids(root_pid))
    cuda = cuda_checkpoint.cuda_processes(pids)
    if not cuda:
        raise CaptureError("no process of the unit (root pid %d) holds a CUDA context: is the engine running on the GPU?" % root_pid)
    used, every = workload_gpus(api, root_pid, pids)
    cuda_checkpoint.lock_all(api, cuda, timeout_ms=timeout_ms)
    return DriverData(cuda_pids=tuple(cuda), gpu_uuids=tuple(used), host_gpu_uuids=tuple(every), driver_version=api.driver_version)


def checkpoint(api: CheckpointApi, data: DriverData) -> None:
    """Checkpoint every locked CUDA process; on failure each is put back to running first."""
    cuda_checkpoint.checkpoint_locked(api, _pids(data))


def resume(api: CheckpointApi, data: DriverData, *, state: str) -> list[str]:
    """Every CUDA process back to running after a failed cut; what could not be, one line each.

    Known states go in the restore order (restore each, then unlock each); ``unknown`` (the
    step failed on this host, which rolled back what it could, or the host did not answer)
    settles each process by the state the driver reports."""
    if state not in STATES:
        raise RequestError("unknown state %r of a unit's CUDA processes (one of %s)" % (state, ", ".join(STATES)))
    if not data.cuda_pids and data.root_pid:
        # The lock never answered: the tree's CUDA processes are found again (a lock leaves
        # their device files open; only a checkpoint, which came after it, closes them).
        data = data.merged(DriverData(cuda_pids=tuple(cuda_checkpoint.cuda_processes(tree_pids(data.root_pid)))))
        if not data.cuda_pids:
            return []
    pids = _pids(data)
    locked = pids if state in ("locked", "checkpointed") else []
    done = pids if state == "checkpointed" else []
    return cuda_checkpoint.resume_all(api, pids, locked=locked, checkpointed=done)


def restore(api: CheckpointApi, data: DriverData, *, visible: str | None) -> None:
    """Every CUDA process of a tree CRIU restored gets its GPUs back (left locked).

    The GPU map names every GPU of the capture host (the driver refuses less); *visible* is
    the ``CUDA_VISIBLE_DEVICES`` that picks the GPUs of this host the workload comes back on."""
    here = api.uuids()
    used, every = data.gpus()
    pairs = cuda_checkpoint.gpu_pairs(used, every, here, cuda_checkpoint.visible_uuids(visible, here))
    cuda_checkpoint.restore_each(api, _pids(data), pairs)


def unlock(api: CheckpointApi, data: DriverData) -> None:
    cuda_checkpoint.unlock_each(api, _pids(data))


def _pids(data: DriverData) -> list[int]:
    pids = list(data.cuda_pids or ())
    if not pids:
        raise RequestError("the unit's driver data names no CUDA process (cuda_pids): capture the workload again")
    return pids
