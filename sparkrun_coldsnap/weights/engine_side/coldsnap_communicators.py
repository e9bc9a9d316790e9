"""vLLM's NCCL communicators let go of before the CUDA checkpoint and made again after it.

Why: NCCL's own checkpoint support assumes a driver that does not carry a communicator across
its checkpoint (every communicator destroyed before the lock, made again after the unlock).
With ``COLDSNAP_COMMUNICATORS=rebuild`` the workers do that: they destroy theirs while the
engine sleeps, before the lock, and create them again after the unlock, before the wake.

What is touched: in a vLLM worker the NCCL communicator of a group of several ranks is its
device communicator's ``pynccl_comm``, bootstrapped over the group's gloo CPU group (rank 0's
unique id broadcast there). Only that object is swapped: the group coordinators stay, with
their names, which compiled code looks groups up by. A stand-in that refuses every use takes
its place while detached, so nothing falls back to torch's own NCCL group (which would make a
communicator no one destroys). torch's NCCL groups are audited: one that made a communicator
cannot be remade in place, and a detach that finds one refuses.

CUDA graphs that captured the communicator's kernels keep it alive (NCCL's destroy waits for
them): the plugin launches such workloads with ``--enforce-eager``.

Standard library, torch and vLLM only: this runs in the engine's interpreter.
"""

from __future__ import annotations

import time
from typing import Any


class DetachedCommunicator:
    """What a group holds between detach and attach: every use is an error that says why."""

    disabled = False  # not "disabled": vLLM would fall back to torch's NCCL group
    available = True

    def __init__(self, group: str) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("the NCCL communicator of group %s was destroyed for a checkpoint and is not attached again yet (%s)" % (self._group, name))


def _coordinators() -> list[tuple[str, Any]]:
    """Every live group coordinator of this worker, in name order (the same on every rank, so
    the collective re-creation meets in the same order everywhere)."""
    from vllm.distributed import parallel_state

    out = []
    for name in sorted(parallel_state._groups):
        group = parallel_state._groups[name]()
        if group is not None:
            out.append((name, group))
    return out


def torch_nccl_initialized() -> list[str]:
    """torch process groups whose NCCL backend made a communicator (each by its ranks)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    made = []
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError, AttributeError):
            continue  # no CUDA backend: a gloo group
        probe = getattr(backend, "_is_initialized", None)
        if callable(probe) and probe():
            made.append("ranks %s" % dist.get_process_group_ranks(pg))
    return made


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Communicators:
    """Mixed into vLLM's worker class; every method name is prefixed to avoid clashes."""

    #: the groups this worker detached: (name, the device its communicator was on); None: attached
    _coldsnap_detached: tuple[tuple[str, Any], ...] | None = None

    def coldsnap_detach_communicators(self) -> dict[str, Any]:
        import torch

        rank = int(getattr(self, "rank", 0) or 0)
        if self._coldsnap_detached is not None:
            raise RuntimeError("rank %d's communicators are already detached (%s)" % (rank, ", ".join(n for n, _ in self._coldsnap_detached) or "none held"))
        made = torch_nccl_initialized()
        if made:
            raise RuntimeError("rank %d: torch's NCCL groups %s made communicators, which cannot be made again in place: this workload cannot be checkpointed" % (rank, "; ".join(made)))
        t = time.monotonic()
        _synchronize()
        detached = []
        for name, group in _coordinators():
            communicator: Any = getattr(group, "device_communicator", None)
            comm = getattr(communicator, "pynccl_comm", None)
            if comm is None or isinstance(comm, DetachedCommunicator) or comm.disabled:
                continue
            # Destroyed here and now (not vLLM's abort in a thread it stops waiting for): the
            # checkpoint must not find the communicator's threads or memory half gone.
            with torch.accelerator.device_index(comm.device.index):
                comm.nccl.ncclCommDestroy(comm.comm)
            communicator.pynccl_comm = DetachedCommunicator(name)
            detached.append((name, comm.device))
        _synchronize()
        self._coldsnap_detached = tuple(detached)
        return {"rank": rank, "detached": [n for n, _ in detached], "seconds": round(time.monotonic() - t, 4)}

    def coldsnap_attach_communicators(self) -> dict[str, Any]:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        rank = int(getattr(self, "rank", 0) or 0)
        t = time.monotonic()
        groups = dict(_coordinators())
        attached = []
        for name, device in self._coldsnap_detached or ():
            group = groups.get(name)
            if group is None:
                raise RuntimeError("rank %d: group %s is gone since its communicator was detached" % (rank, name))
            # Collective over the group's gloo CPU group, which came back with the process:
            # rank 0 makes a unique id and broadcasts it, every rank joins, a warm-up all-reduce.
            group.device_communicator.pynccl_comm = PyNcclCommunicator(group=group.cpu_group, device=device)
            attached.append(name)
        self._coldsnap_detached = None
        made = torch_nccl_initialized()
        if made:
            raise RuntimeError("rank %d: torch's NCCL groups %s made communicators while attaching" % (rank, "; ".join(made)))
        _synchronize()
        return {"rank": rank, "attached": attached, "seconds": round(time.monotonic() - t, 4)}
