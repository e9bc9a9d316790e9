"""Facts about the NVIDIA driver that decide which GPU snapshot driver may run."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import gpu_platform
from sparkrun_coldsnap.host.facts import HostFacts
from sparkrun_coldsnap.host.runner import run

# The minimum driver branches by architecture live with the rest of the platform's facts.
MIN_X86 = gpu_platform.MIN_X86
MIN_ARM = gpu_platform.MIN_ARM
driver_major = gpu_platform.driver_branch
IPC_MIN = 610  # CUDA IPC handles (e.g. vLLM's custom all-reduce) survive only from here


@functools.lru_cache(maxsize=1)
def has_checkpoint_api() -> bool:
    """Does this host's libcuda export cuCheckpointProcessLock?"""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return hasattr(lib, "cuCheckpointProcessLock")


def checkpoint_api_problem(host: HostFacts) -> str | None:
    """Why the process checkpoint API cannot be used here, or None (host/gpu_platform.py judges the
    driver and chip; this adds whether the installed libcuda exports the API)."""
    p = gpu_platform.reading(host)
    if not p.checkpoint_api:
        return p.checkpoint_reason
    if not has_checkpoint_api():
        return "libcuda.so.1 has no cuCheckpointProcess* functions: update the NVIDIA driver"
    return None


def _compute_apps(column: str, pids: Iterable[int]) -> list[str]:
    """*column* of every process among *pids* that holds memory on a GPU, one row per GPU it
    uses, as the driver reports it (none where there is no nvidia-smi or no answer)."""
    wanted = {str(p) for p in pids}
    try:
        out = run(["nvidia-smi", "--query-compute-apps=pid,%s" % column, "--format=csv,noheader,nounits"], timeout=30, check=False).stdout
    except ToolError:
        return []
    fields = [[f.strip() for f in line.split(",")] for line in out.splitlines()]
    return [f[1] for f in fields if len(f) == 2 and f[0] in wanted]


def gpus_of(pids: Iterable[int]) -> list[str]:
    """The GPUs (UUIDs) on which the processes *pids* hold memory, as the driver reports it."""
    return sorted(set(_compute_apps("gpu_uuid", pids)))


def memory_of(pids: Iterable[int]) -> int:
    """Bytes of GPU memory the processes *pids* hold, as the driver reports it (0 where it
    reports nothing): what a CUDA checkpoint moves into their host memory, and so into a dump."""
    return sum(int(mib) << 20 for mib in _compute_apps("used_memory", pids) if mib.isdigit())
