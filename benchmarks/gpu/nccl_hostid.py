"""Two NCCL ranks on one GPU, each believing it is on a host of its own.

NCCL groups ranks into hosts by a host hash that ``NCCL_HOSTID`` overrides. Ranks with
different ids share no memory, talk over the NET transport (sockets here: IB, P2P, SHM and
NVLS off) and may use the same physical GPU; with the same id NCCL refuses them as a
duplicate GPU. This runs both: an all-reduce of two ranks on ``cuda:0`` with two host ids
(NCCL's log must say "via NET/Socket"), then the same ranks with one id (refused).

  python3 benchmarks/gpu/nccl_hostid.py [--netns A,B --addrs 10.99.0.1,10.99.0.2 --ifname veth]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RANK = r"""
import os, sys, time, torch, torch.distributed as dist
t0 = time.monotonic()
dist.init_process_group("nccl", init_method="tcp://%s:%s" % (os.environ["ADDR"], os.environ["PORT"]), rank=int(os.environ["RANK"]), world_size=2)
torch.cuda.set_device(0)
x = torch.full((1 << 20,), float(int(os.environ["RANK"]) + 1), device="cuda:0")
dist.all_reduce(x)
torch.cuda.synchronize()
ok = bool((x == 3.0).all().item())
print("RESULT rank=%s ok=%s seconds=%.2f" % (os.environ["RANK"], ok, time.monotonic() - t0), flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
"""

SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def collect(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """A rank's exit status and output; one that does not end in *timeout* seconds is killed."""
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        text, _ = p.communicate()
        text += "\nno end in %.0f s (killed)" % timeout
    return p.returncode, text


def run_pair(host_ids: tuple[str, str], *, netns: tuple[str, str] | None, addrs: tuple[str, str], ifname: str, port: int) -> dict:
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ, **SAFE, "RANK": str(rank), "ADDR": addrs[0], "PORT": str(port), "NCCL_HOSTID": host_ids[rank],
            "NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": ifname,
            "CUDA_VISIBLE_DEVICES": "0",
        }  # fmt: skip
        argv = [sys.executable, "-c", RANK]
        if netns:
            argv = ["ip", "netns", "exec", netns[rank], *argv]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = [collect(p, 180) for p in procs]
    logs = "\n".join(t for _, t in out)
    return {
        "host_ids": list(host_ids),
        "netns": list(netns) if netns else None,
        "exit_codes": [rc for rc, _ in out],
        "results": [line for _, t in out for line in t.splitlines() if line.startswith("RESULT")],
        "via_net_socket": sum("via NET/Socket" in line for line in logs.splitlines()),
        "via_p2p_or_shm": sum(("via P2P" in line or "via SHM" in line) for line in logs.splitlines()),
        "duplicate_gpu": "Duplicate GPU" in logs or "duplicate GPU" in logs.lower(),
        "tail": [line for line in logs.splitlines() if "NCCL WARN" in line or "Error" in line or "via NET" in line][-8:],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--netns", default="")
    ap.add_argument("--addrs", default="127.0.0.1,127.0.0.1")
    ap.add_argument("--ifname", default="lo")
    ap.add_argument("--port", type=int, default=29533)
    a = ap.parse_args()
    netns = tuple(a.netns.split(",")) if a.netns else None
    addrs = tuple(a.addrs.split(","))
    t = time.monotonic()
    two = run_pair(("coldsnap-host-a", "coldsnap-host-b"), netns=netns, addrs=addrs, ifname=a.ifname, port=a.port)  # type: ignore[arg-type]
    one = run_pair(("coldsnap-host-a", "coldsnap-host-a"), netns=netns, addrs=addrs, ifname=a.ifname, port=a.port + 1)  # type: ignore[arg-type]
    report = {"two_host_ids": two, "one_host_id": one, "seconds": round(time.monotonic() - t, 1)}
    print(json.dumps(report, indent=1))
    passed = two["exit_codes"] == [0, 0] and two["via_net_socket"] > 0 and two["via_p2p_or_shm"] == 0 and one["exit_codes"] != [0, 0]
    print("NCCL_HOSTID check: %s" % ("two ranks on one GPU as two hosts, over NET/Socket; one id refused" if passed else "NOT as expected"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
