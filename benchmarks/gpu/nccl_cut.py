"""Whether NCCL ranks on one GPU, joined over sockets, compute again after a CUDA cut.

Two processes on ``cuda:0``: each multiplies two matrices and, with ``--nccl``, all-reduces a
tensor with the other (each with a host id of its own: NET/Socket, IB, P2P, SHM and NVLS
off). Then the CUDA half of a cut across both (cuda_cut_two_hosts.py: every process locked,
checkpointed, restored, unlocked) while they wait, and each does the same work again and
says whether its results are still right. Without ``--nccl`` the two are independent: that
separates what the checkpoint does to two contexts on one GPU from what it does to NCCL.
With ``--reinit`` each rank destroys its communicator before the cut and creates a new one
after it, as a driver that does not keep communicators across the cut would. ``--ranks 1``: one
process alone (a communicator of one rank); ``--env BACKEND=gloo``: the same collectives through
gloo instead of NCCL (CUDA tensors reduced through host memory); ``--env SETTLE=S``: wait S
seconds after the destroy.

  PYTHONPATH=$WORK/plugin-site python3 benchmarks/gpu/nccl_cut.py [--nccl [--reinit]] [--env NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from cuda_cut_two_hosts import cut
from nccl_hostid import collect

RANK = r"""
import os, sys, torch
nccl = os.environ["WITH_NCCL"] == "1"
reinit = os.environ["REINIT"] == "1"
rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
if nccl:
    import torch.distributed as dist
    dist.init_process_group(os.environ.get("BACKEND", "nccl"), init_method="tcp://127.0.0.1:%s" % os.environ["PORT"], rank=rank, world_size=int(os.environ["WORLD"]))
g = torch.Generator(device="cuda:0").manual_seed(7)
a = torch.randn(2048, 2048, device="cuda:0", generator=g)
want = (a @ a).sum().item()

def work(when):
    try:
        got = (a @ a).sum().item()
        line = "RESULT %s rank=%d matmul_ok=%s" % (when, rank, abs(got - want) < 1e-3 * abs(want))
        if nccl:
            x = torch.full((1 << 20,), float(rank + 1), device="cuda:0")
            dist.all_reduce(x)
            torch.cuda.synchronize()
            line += " allreduce_ok=%s" % bool((x == sum(range(1, int(os.environ["WORLD"]) + 1))).all().item())
    except Exception as err:
        line = "RESULT %s rank=%d error=%r" % (when, rank, str(err)[:200])
    print(line, flush=True)

work("before")
if nccl and reinit:
    dist.destroy_process_group()
    torch.cuda.synchronize()
    import time
    time.sleep(float(os.environ.get("SETTLE", "0")))
print("READY", flush=True)
sys.stdin.readline()
if nccl and reinit:
    dist.init_process_group(os.environ.get("BACKEND", "nccl"), init_method="tcp://127.0.0.1:%d" % (int(os.environ["PORT"]) + 1), rank=rank, world_size=int(os.environ["WORLD"]))
work("after")
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--reinit", action="store_true", help="destroy the communicator before the cut, create a new one after it")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for both ranks")
    ap.add_argument("--port", type=int, default=29544)
    ap.add_argument("--ranks", type=int, default=2, help="1: one process alone, a communicator of one rank")
    a = ap.parse_args()
    extra = dict(e.split("=", 1) for e in a.env)
    procs = []
    for rank in range(a.ranks):
        env = {
            **os.environ, "RANK": str(rank), "PORT": str(a.port), "WITH_NCCL": "1" if a.nccl else "0", "REINIT": "1" if a.reinit else "0", "CUDA_VISIBLE_DEVICES": "0", "WORLD": str(a.ranks),
            "NCCL_HOSTID": "coldsnap-host-%d" % rank, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo", **extra,
        }  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    lines: list[str] = []
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.rstrip())
            if line.startswith("READY"):
                break
    report = {"nccl": a.nccl, "reinit": a.reinit, "env": extra, "cut": cut([p.pid for p in procs])}
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        lines += collect(p, 120)[1].splitlines()
    report["results"] = [line for line in lines if line.startswith("RESULT")]
    report["warnings"] = [line for line in lines if "NCCL WARN" in line or "rror" in line][-6:]
    print(json.dumps(report, indent=1), flush=True)
    return 0 if all("_ok=True" in r and "False" not in r for r in report["results"] if "after" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
