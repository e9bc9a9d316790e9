"""A native payload copied into memory from its packed copy against from the file itself, page
cache dropped before each copy: what a node with nothing prepared waits for, apart from any engine.

    python3 benchmarks/gpu/packed_probe.py --gib 8 --samples 3 [--dir /root/packed-probe]

The file holds bf16 values as a serving engine does (normally distributed, rounded): a block of
random values written again and again (each piece of the packed copy is compressed on its own,
so repeating the block does not help it). Prints the packing, and the medians of both copies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import numpy as np

from sparkrun_coldsnap.weights import packed_payload, page_cache, weights_memory

BLOCK = 256 << 20


def bf16_block(nbytes: int, seed: int = 0) -> bytes:
    f = (np.random.default_rng(seed).standard_normal(nbytes // 2, dtype=np.float32) * 0.02).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/root/packed-probe"))
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    raw = a.dir / "rank-0.bin"
    block = bf16_block(BLOCK)
    with open(raw, "wb") as f:
        for _ in range((a.gib << 30) // BLOCK):
            f.write(block)
    t = time.monotonic()
    index = packed_payload.pack(raw, "sha256:" + hashlib.sha256(block).hexdigest())
    packing = time.monotonic() - t
    assert index is not None
    size = raw.stat().st_size
    print("packed %.1f GB to %.1f GB (%.3f) in %.1f s" % (size / 1e9, index.packed_bytes / 1e9, index.packed_bytes / size, packing), flush=True)
    times: dict[str, list[float]] = {"file": [], "packed copy": []}
    for _ in range(a.samples):
        for how, packed in (("file", None), ("packed copy", {raw: index})):
            page_cache.drop()
            t = time.monotonic()
            staged = weights_memory.copy_into_memory([raw], packed=packed)
            times[how].append(time.monotonic() - t)
            staged.release()
            print("  %-12s %.2f s" % (how, times[how][-1]), flush=True)
    out = {"bytes": size, "packed_bytes": index.packed_bytes, "pack_seconds": round(packing, 2)}
    for how, ts in times.items():
        m = statistics.median(ts)
        out[how] = {"median_seconds": round(m, 3), "min": round(min(ts), 3), "max": round(max(ts), 3), "n": len(ts), "gb_per_s_into_memory": round(size / m / 1e9, 2)}
        print("%-12s median %.2f s (%.2f GB/s into memory)" % (how, m, size / m / 1e9))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
