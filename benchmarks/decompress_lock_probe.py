"""How fast a Python loop runs beside a thread decompressing the payload's packed pieces, with
blosc2 holding the interpreter lock through each call and with it let go (what the packed
payload's copy sets): the restore's own Python threads (the capsule's unpacking, the memory
fill) run beside that copy on a node with nothing prepared.

    python benchmarks/decompress_lock_probe.py [--seconds 2] [--samples 3]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time

import blosc2
import numpy as np


def piece() -> tuple[bytes, int]:
    """One 16 MiB piece of bf16-like values, packed as the payload's copy packs it."""
    values = (np.random.default_rng(0).standard_normal(8 << 20).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    raw = values.tobytes()
    return bytes(blosc2.compress2(raw, codec=blosc2.Codec.ZSTD, clevel=1, filters=[blosc2.Filter.SHUFFLE], typesize=2)), len(raw)


def loop_rate(seconds: float) -> float:
    """Iterations per second of a loop that needs the interpreter lock all the time."""
    t, n = time.monotonic(), 0
    while time.monotonic() - t < seconds:
        hashlib.sha256(b"x" * 100)
        n += 1
    return n / seconds


def beside_decompression(packed: bytes, size: int, seconds: float) -> float:
    out, stop = bytearray(size), threading.Event()

    def decompress() -> None:
        while not stop.is_set():
            blosc2.decompress2(packed, dst=memoryview(out), nthreads=1)

    worker = threading.Thread(target=decompress)
    worker.start()
    try:
        return loop_rate(seconds)
    finally:
        stop.set()
        worker.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    packed, size = piece()
    for release in (False, True):
        blosc2.set_releasegil(release)
        shares = [beside_decompression(packed, size, args.seconds) / loop_rate(args.seconds) for _ in range(args.samples)]
        print("lock %s: the loop beside decompression runs at %.0f%% of its speed alone (median of %d)" % ("let go" if release else "held", 100 * statistics.median(shares), args.samples))


if __name__ == "__main__":
    main()
