"""Several GPU ranks in one unit (tensor or pipeline parallel): launched so the CUDA checkpoint
API can carry them, checkpointed and restored together.

Why the ranks are launched the way they are
    The driver's checkpoint cannot carry memory one process shares with another (CUDA IPC,
    cuMem handles exported as file descriptors or fabric handles, multicast objects) before
    driver 610 with processes started under its checkpoint job file. With such sharing a call
    on one process blocks while a peer is locked (NVIDIA/cuda-checkpoint#30), checkpointing
    one rank of a running NCCL job hangs (#45), and NVLink SHARP multicast hangs the
    checkpoint outright (NVIDIA/nccl#2337). NCCL creates that sharing only in its P2P, SHM
    and NVLS transports and vLLM/SGLang only in their own all-reduce kernels; with all of
    them off NCCL talks over sockets, and tensor-parallel vLLM was checkpointed and restored
    that way on H100s (NVIDIA/nvcf#1183). So a unit of several ranks starts with
    ``IPC_FREE_NCCL`` in its environment and the engine's IPC-free flags, and the ranks of
    one host talk over loopback: their connections are TCP connections between processes
    of the same tree, which CRIU restores with both ends (``--tcp-established``), and they
    do not depend on the host's address.

Kept or rebuilt communicators (``COLDSNAP_COMMUNICATORS``)
    ``keep`` (the default) carries the NCCL communicators across the checkpoint with the rest
    of the device memory, as tensor-parallel vLLM was restored on H100s (NVIDIA/nvcf#1183).
    ``rebuild`` follows the order NCCL's own checkpoint support documents: an engine whose
    workers can (``EngineAdapter.rebuilds_communicators``) is launched with what that takes
    (vLLM: the plugin's worker extension, and eager execution, since CUDA graphs that captured
    NCCL kernels keep the communicator alive); the controller has every worker destroy its
    communicators while the engine sleeps, before the lock, and make them again over the CPU
    group that came back with the process, after the unlock, before the wake; the capsule says
    so (``DriverData.communicators_detached``). On one H100 shared by two ranks (two host ids,
    sockets) neither came through on driver 580.159.04: the first kernel after the unlock
    failed ("unspecified launch failure") with the communicator kept and with it destroyed
    before the lock, where two plain CUDA processes, two gloo ranks and one NCCL rank came
    through the same cut (docs/gpu-ranks.md). Which one two GPUs need is not measured.

The order over every CUDA process of the tree
    Capture: lock every process (no rank may run a kernel once a peer is frozen), then
    checkpoint every process, then dump. Restore: the tree comes back from CRIU still
    checkpointed; restore every process (each with the same whole-host GPU map), then unlock
    every one; the engine then wakes (the adapter's hydration). Any failure before the dump
    completes puts every process back to running, as it was: first what this capture is known
    to have locked or checkpointed, which also lets a call blocked behind a locked peer go
    through, then whatever the driver says the rest are in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda.checkpoint import CheckpointApi
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.engines.base import flag_value, has_flag
from sparkrun_coldsnap.errors import RequestError, RestoreError
from sparkrun_coldsnap.host.facts import gpu_facts

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.request import Topology
    from sparkrun_coldsnap.documents.unit_image import UnitImage
    from sparkrun_coldsnap.engines.base import EngineAdapter

#: NCCL without any transport that shares device or pinned memory between processes.
IPC_FREE_NCCL = {
    "NCCL_P2P_DISABLE": "1",  # P2P maps a peer's buffers (cudaIpc or cuMem POSIX-fd handles)
    "NCCL_SHM_DISABLE": "1",  # SHM shares host buffers between ranks (cuMem host handles, nccl#2350)
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP multicast objects hang the checkpoint (nccl#2337)
    "NCCL_CUMEM_ENABLE": "0",  # no cuMem handles exported at all
    "NCCL_IB_DISABLE": "1",  # RDMA verbs (/dev/infiniband) are not dumpable by CRIU
    "NCCL_NET": "Socket",
}
#: Ranks of one host reach each other on loopback: inside the tree, and the same on any host.
LOOPBACK = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def several_ranks(topology: Topology) -> bool:
    return topology.tensor_parallel * topology.pipeline_parallel > 1


def launch_settings(command: str, env: Mapping[str, str], *, adapter: EngineAdapter, topology: Topology) -> tuple[str, dict[str, str]]:
    """The command and environment a unit of several GPU ranks needs to be checkpointable.

    A recipe that sets one of these the other way is refused: it would launch a unit whose
    checkpoint hangs (the error names the setting and why)."""
    out = dict(env)
    if not several_ranks(topology):
        return command, out
    wanted = {**IPC_FREE_NCCL, **adapter.ipc_free_env}
    if len(topology.hosts) == 1:
        wanted.update(LOOPBACK)
    for name, value in wanted.items():
        if name in env and env[name] != value:
            raise RequestError(
                "%s=%s in the engine's environment (the recipe's or sparkrun's): a unit of several GPU ranks must run with %s=%s to be captured "
                "(its ranks may not share device memory: the CUDA checkpoint cannot carry it); remove it or use driver n580" % (name, env[name], name, value)
            )
        out[name] = value
    for flag in adapter.ipc_flags:
        if has_flag(command, flag) and flag_value(command, flag) not in ("false", "False", "0"):
            raise RequestError("%s in the serve command: it makes the ranks share device memory, which the CUDA checkpoint cannot carry; remove it or use driver n580" % flag)
    for flag in adapter.ipc_free_flags:
        if not has_flag(command, flag):
            command = command + " " + flag
    if rebuilds_communicators(adapter, topology):
        command, out = adapter.communicator_launch(command, out)
    return command, out


def rebuilds_communicators(adapter: EngineAdapter, topology: Topology) -> bool:
    """Whether the workers' NCCL communicators are destroyed before the CUDA checkpoint and made
    again after it (several ranks, ``COLDSNAP_COMMUNICATORS=rebuild``, an engine that can)."""
    if not (several_ranks(topology) and settings.current().rebuild_communicators):
        return False
    if not adapter.rebuilds_communicators:
        raise RequestError("COLDSNAP_COMMUNICATORS=rebuild: %s's workers cannot rebuild their NCCL communicators; unset it to keep them" % adapter.name)
    return True


def capture[T](api: CheckpointApi, pids: Sequence[int], dump: Callable[[], T], *, timeout_ms: int = cuda_checkpoint.LOCK_TIMEOUT_MS) -> T:
    """Lock every CUDA process, checkpoint every one, then *dump*; on any failure every
    process is put back to running before the error goes on."""
    cuda_checkpoint.checkpoint_all(api, pids, timeout_ms=timeout_ms)
    try:
        return dump()
    except BaseException as err:
        problems = cuda_checkpoint.resume_all(api, pids, locked=pids, checkpointed=pids)
        if problems:
            err.args = ("%s; putting the CUDA processes back to running also failed: %s" % (err.args[0] if err.args else err, "; ".join(problems)),)
        raise


def restore(api: CheckpointApi, pids: Sequence[int], pairs: Sequence[tuple[str, str]] = ()) -> None:
    """Restore every process (each with the same whole-host GPU map), then unlock every one.

    A failure leaves the tree unusable (some ranks may hold their device, some not): the
    caller stops it."""
    cuda_checkpoint.restore_all(api, pids, pairs)


def gpu_problems(unit: UnitImage) -> list[str]:
    """Admission: whether this host shows as many GPUs as the captured ranks used (and as the
    capture host had: the restore's GPU map names every one), before anything is stopped.

    The same rule the restore's GPU map applies (``cuda_checkpoint.gpu_pairs``), asked early: a
    unit of several ranks needs several GPUs visible here."""
    used, every = unit.driver_data.gpus()
    here = [g.uuid for g in gpu_facts().gpus if g.uuid]
    if not here:
        return []  # the driver's tool did not list them: the restore's own check still applies
    try:
        cuda_checkpoint.gpu_pairs(used, every, here, cuda_checkpoint.visible_uuids(settings.current().cuda_visible_devices, here))
    except RestoreError as err:
        return [str(err)]
    return []
