"""The CUDA half of a cut across two hosts, on two serving ranks: every rank's CUDA processes
locked, then every one checkpointed (device memory moved to host memory), then every one
restored, then every one unlocked, in the order controller/cut.py gives the steps across hosts;
each step timed, and the GPU memory in use after the checkpoint. The caller asks the engine
again afterwards: NCCL's communicators over sockets must carry the next request.

  PYTHONPATH=$WORK/plugin-site python3 benchmarks/gpu/cuda_cut_two_hosts.py ROOT_PID_A ROOT_PID_B
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.host.process_tree import tree_pids


def gpu_memory_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def cut(roots: list[int]) -> dict:
    """Lock, checkpoint, restore and unlock the CUDA processes of every tree in *roots*, each
    step on every tree before the next; what each step took."""
    ranks = [cuda_checkpoint.cuda_processes(tree_pids(root)) for root in roots]
    api = cuda_checkpoint.HelperProcess()
    every = [pid for pids in ranks for pid in pids]
    report: dict = {"cuda_pids": ranks, "gpu_mib_serving": gpu_memory_mib()}
    # Each step on every rank before the next on any (controller/cut.py): every host's
    # processes locked before any host checkpoints, every host's back on the GPU, still
    # locked, before any unlocks.
    steps = [
        ("lock", lambda pids: cuda_checkpoint.lock_all(api, pids)),
        ("checkpoint", lambda pids: cuda_checkpoint.checkpoint_locked(api, pids)),
        ("restore", lambda pids: cuda_checkpoint.restore_each(api, pids)),
        ("unlock", lambda pids: cuda_checkpoint.unlock_each(api, pids)),
    ]
    for name, step in steps:
        t = time.monotonic()
        for pids in ranks:
            step(pids)
        report["%s_seconds" % name] = round(time.monotonic() - t, 3)
        if name == "checkpoint":
            report["gpu_mib_checkpointed"] = gpu_memory_mib()
    report["gpu_mib_restored"] = gpu_memory_mib()
    report["processes"] = len(every)
    return report


def main() -> int:
    print(json.dumps(cut([int(p) for p in sys.argv[1:]])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
