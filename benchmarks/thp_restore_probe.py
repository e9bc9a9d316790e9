"""Does `criu restore` write memory faster with transparent huge pages on?

Writing fresh memory in 4 KiB faults is what bounds a restore that copies every page first
(the GPU drivers' restore), and huge pages write several times faster on these virtual
machines. CRIU asks for no huge pages in the areas it fills (it applies a dumped area's
MADV_HUGEPAGE only after filling it), so only the host-wide setting `always` could give
them. This dumps one process holding a dense area (every page non-zero, like weights or
a heap) and a sparse one (one page in every 64 KiB, like a fragmented heap or an arena),
then restores it with the host's setting at `madvise` and at `always`, alternating, and
prints the medians. It changes /sys/kernel/mm/transparent_hugepage/enabled while it runs
and puts the old value back. Needs root and CRIU.

    python3 benchmarks/thp_restore_probe.py --criu PATH --dense-mib 1024 --sparse-mib 1024 --samples 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

HOLDER = r"""
import mmap, os, sys, time
dense, sparse = int(sys.argv[1]) << 20, int(sys.argv[2]) << 20
a = mmap.mmap(-1, dense, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a heap: private, not shared
block = os.urandom(1 << 20)
for off in range(0, dense, 1 << 20):
    a[off:off + (1 << 20)] = block
b = mmap.mmap(-1, sparse, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(0, sparse, 64 << 10):
    b[off:off + 8] = b"coldsnap"
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def thp_mode() -> str:
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def restore_once(criu: str, images: Path, mode: str) -> float:
    THP.write_text(mode)
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    t = time.monotonic()
    subprocess.run([criu, "restore", "-D", str(images), "-d", "--shell-job", "--pidfile", str(pidfile), "-o", "restore.log"], check=True)
    seconds = time.monotonic() - t
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGKILL)
    while os.path.exists("/proc/%d" % pid):
        time.sleep(0.01)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--criu", default=shutil.which("criu") or "criu", help="a criu >= 4.2 that runs as it is (the wrapper `setup --docker` writes does)")
    ap.add_argument("--dense-mib", type=int, default=1024)
    ap.add_argument("--sparse-mib", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="thp-probe-", dir="/dev/shm"))  # images in memory, as staged
    before = thp_mode()
    log = work.parent / (work.name + ".log")  # a plain file: CRIU reopens it at restore
    with open(log, "wb") as out:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(args.dense_mib), str(args.sparse_mib)], stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        while b"ready" not in log.read_bytes():
            if holder.poll() is not None:
                raise SystemExit("the holder process ended: %s" % log.read_text())
            time.sleep(0.1)
        subprocess.run([args.criu, "dump", "-t", str(holder.pid), "-D", str(work), "--shell-job", "-o", "dump.log"], check=True)
        holder.wait()
        image_bytes = sum(p.stat().st_size for p in work.glob("pages-*.img"))
        times: dict[str, list[float]] = {"madvise": [], "always": []}
        for i in range(args.samples):
            for mode in ("madvise", "always") if i % 2 == 0 else ("always", "madvise"):
                times[mode].append(restore_once(args.criu, work, mode))
                print("sample %d/%d  %-7s  criu restore %.3f s" % (i + 1, args.samples, mode, times[mode][-1]), flush=True)
    finally:
        THP.write_text(before)
        if holder.poll() is None:
            holder.kill()
        shutil.rmtree(work, ignore_errors=True)
        log.unlink(missing_ok=True)
    result = {
        "dense_mib": args.dense_mib, "sparse_mib": args.sparse_mib, "pages_image_bytes": image_bytes, "samples": times,
        "median_seconds": {m: round(statistics.median(v), 3) for m, v in times.items()},
        "rate_gb_s": {m: round(image_bytes / statistics.median(v) / 1e9, 2) for m, v in times.items()},
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
