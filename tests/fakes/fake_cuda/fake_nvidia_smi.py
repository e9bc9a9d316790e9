"""FAKE ``nvidia-smi`` (tests only): the fake GPUs of ``$FAKE_CUDA_DIR`` as the real tool prints them.

Answers the three forms the plugin runs: the bare header (driver and CUDA versions),
``--query-gpu=name,compute_cap,memory.total,uuid,driver_version`` and
``--query-compute-apps=pid,gpu_uuid`` (the live processes holding a context, from the
fake driver's records) and ``--query-compute-apps=pid,used_memory`` (each such process's
device memory: a fake context holds ``CONTEXT_MIB``); anything else fails as an unknown option
does.
"""

from __future__ import annotations

import os
import sys

import fake_gpu_state as gpu

DRIVER = "580.159.04"
CUDA = "13.0"
CONTEXT_MIB = 512  # what one fake context holds on each of its GPUs


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main(argv: list[str]) -> int:
    if not argv:
        print("| NVIDIA-SMI %s    Driver Version: %s    CUDA Version: %s |" % (DRIVER, DRIVER, CUDA))
        return 0
    query = next((a for a in argv if a.startswith("--query-")), None)
    if query == "--query-gpu=name,compute_cap,memory.total,uuid,driver_version":
        for g in gpu.gpus():
            print("%s, 9.0, 143771, %s, %s" % (g["chip"], g["uuid"], DRIVER))
        return 0
    if query in ("--query-compute-apps=pid,gpu_uuid", "--query-compute-apps=pid,used_memory"):
        units = "--format=csv,noheader,nounits" in argv
        for path in sorted(gpu.root().glob("proc-*.json")):
            pid = int(path.stem.split("-")[1])
            rec = gpu.read_proc(pid)
            if rec and alive(pid) and rec["state"] != "checkpointed":
                for g in rec["gpus"]:
                    used = "%d" % CONTEXT_MIB if units else "%d MiB" % CONTEXT_MIB
                    print("%d, %s" % (pid, g["uuid"] if query.endswith("gpu_uuid") else used))
        return 0
    print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
