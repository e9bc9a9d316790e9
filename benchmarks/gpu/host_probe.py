"""What the host does with memory and the disk, measured in the ways a restore uses them.

    python3 benchmarks/gpu/host_probe.py memory [--gib 4]
    python3 benchmarks/gpu/host_probe.py disk FILE [FILE...] [--readers 8,16,32] [--block-mib 4,16]

``memory``: the host's transparent huge page settings, then the rate of writing whole pages
into memory (what ``criu restore`` does for every page it restores: fault, clear, copy):
into memory never touched, the same again right after the first area was freed (whether a
freshly freed page comes back cheaper than a page the virtual machine never backed), into
pages already faulted (the copy alone), after a pause (whether the guest hands freed pages
back to the host, which makes them fresh again), with huge pages asked for (``MADV_HUGEPAGE``), and
from several threads at once.

``disk``: direct reads of FILEs (the weights, say) by N readers at once in blocks of B MiB,
each reader with a buffer of its own faulted in beforehand, the page cache dropped before
each pass: how fast a cold node can read what it has to.

Prints one JSON document (standard library only; run as root for the page cache drop).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time
from pathlib import Path

PAGE = 4096
MIB = 1 << 20
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
MADV_HUGEPAGE = 14


def _address(area: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(area))


def _fill(addr: int, nbytes: int, threads: int) -> float:
    """Seconds to write every byte of [addr, addr + nbytes) from *threads* threads (ctypes
    calls let go of the interpreter's lock, so the threads really run side by side)."""
    part = nbytes // threads // PAGE * PAGE
    spans = [(addr + i * part, part if i < threads - 1 else nbytes - i * part) for i in range(threads)]
    workers = [threading.Thread(target=LIBC.memset, args=(a, 1, n)) for a, n in spans]
    t = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - t


def _area(nbytes: int, *, huge: bool = False) -> tuple[mmap.mmap, int]:
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = _address(area)
    if huge:
        LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    return area, addr


def _close(area: mmap.mmap) -> None:
    try:
        area.close()
    except BufferError:
        pass


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def memory(gib: float, pause: float = 5.0) -> dict:
    nbytes = int(gib * (1 << 30)) // (2 * MIB) * (2 * MIB)
    out: dict = {"bytes": nbytes}
    for name in ("enabled", "defrag", "shmem_enabled"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / name
        out["thp_" + name] = p.read_text().strip() if p.exists() else None
    rates: dict[str, float] = {}
    runs = (("fresh", False, 1), ("fresh_again", False, 1), ("fresh_after_pause", False, 1), ("fresh_thp", True, 1), ("fresh_4_threads", False, 4), ("fresh_8_threads", False, 8))
    for label, huge, threads in runs:
        if label == "fresh_after_pause":
            time.sleep(pause)  # time for the guest to hand freed pages back to the host, if it does
        area, addr = _area(nbytes, huge=huge)
        rates[label] = _rate(nbytes, _fill(addr, nbytes, threads))
        if label == "fresh":
            rates["faulted"] = _rate(nbytes, _fill(addr, nbytes, 1))  # the same pages again: the copy alone
        _close(area)
    out["write_gb_per_s"] = rates
    return out


def _drop_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _read_pass(files: list[Path], readers: int, block: int) -> tuple[int, float]:
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size // block * block, block)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    lock, done = threading.Lock(), [0]

    def reader(k: int) -> None:
        buf = mmap.mmap(-1, block)
        buf.write(b"\1" * block)  # faulted in before the clock, as a reused buffer is
        view = memoryview(buf)
        try:
            for f, off in jobs[k::readers]:
                n = os.preadv(fds[f], [view], off)
                with lock:
                    done[0] += n
        finally:
            view.release()
            buf.close()

    workers = [threading.Thread(target=reader, args=(k,)) for k in range(readers)]
    t = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.monotonic() - t
    for fd in fds.values():
        os.close(fd)
    return done[0], seconds


def disk(files: list[Path], readers: list[int], blocks: list[int]) -> dict:
    out = []
    for block in blocks:
        for n in readers:
            _drop_cache()
            nbytes, seconds = _read_pass(files, n, block * MIB)
            out.append({"readers": n, "block_mib": block, "bytes": nbytes, "seconds": round(seconds, 3), "gb_per_s": _rate(nbytes, seconds)})
            print(json.dumps(out[-1]), flush=True)
    return {"files": [str(f) for f in files], "reads": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("memory", "disk"))
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--readers", default="8,16,32")
    ap.add_argument("--block-mib", default="4,16")
    args = ap.parse_args()
    if args.what == "memory":
        doc = memory(args.gib)
    else:
        doc = disk(args.files, [int(x) for x in args.readers.split(",")], [int(x) for x in args.block_mib.split(",")])
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
