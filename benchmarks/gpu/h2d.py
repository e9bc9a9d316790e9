"""Host-to-device and device-to-host bandwidth of this GPU from pinned memory, in the
engine's interpreter (torch with CUDA): the bus a restore hydrates weights over.

    python3 benchmarks/gpu/h2d.py [--gib 4]      # prints one JSON line, bytes per second
"""

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = {"host_to_device": [], "device_to_host": []}
    for _ in range(args.repeat):
        for name, (dst, src) in {"host_to_device": (dev, host), "device_to_host": (host, dev)}.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[name].append(n / (time.perf_counter() - t))
    print(json.dumps({k: statistics.median(v) for k, v in rates.items()}))


if __name__ == "__main__":
    main()
