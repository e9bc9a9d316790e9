"""How much faster does a restore come back when several threads write the big memory areas?

`criu restore` writes a process's pages with one thread, bound by 4 KiB page faults. This
dumps one process holding N MiB of non-zero private memory (optionally a child holding M
MiB of its own), then restores it, alternating: with every page in CRIU's images, and split
(the plugin's page_fill: CRIU restores the rest and leaves the tree stopped, T threads write
the big areas, the tree is continued) for each thread count asked. It prints the medians of
the criu restore, the fill, and the whole restore call, and checks once per mode that the
restored memory is byte for byte what was dumped. Images sit in /dev/shm, as staged. Needs
root and CRIU; runs the plugin from this checkout.

    python3 benchmarks/page_fill_probe.py --mib 2048 --threads 1,4,8 --samples 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparkrun_coldsnap.criu import page_fill  # noqa: E402
from sparkrun_coldsnap.criu import tree as criu_tree  # noqa: E402
from sparkrun_coldsnap.criu.tool import Criu  # noqa: E402
from sparkrun_coldsnap.documents import settings  # noqa: E402
from sparkrun_coldsnap.host.process_tree import kill_tree  # noqa: E402
from sparkrun_coldsnap.launch.local import start_unit  # noqa: E402

HOLDER = r"""
import hashlib, mmap, os, signal, sys, time

def filled(mib, salt):
    area = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a heap: private, not shared
    block = os.urandom(1 << 20)
    for i in range(mib):
        area[i << 20 : (i + 1) << 20] = block
        area[i << 20 : (i << 20) + 16] = b"%08d%08d" % (salt, i)  # every MiB its own
    return area

def tell(area):
    print("digest %d %s" % (os.getpid(), hashlib.sha256(area).hexdigest()), flush=True)

area = filled(int(sys.argv[1]), 1)
child = 0
if int(sys.argv[2]):
    child = os.fork()
    if child == 0:
        inherited, area = area, filled(int(sys.argv[2]), 2)
        inherited.close()  # its own memory only, as a spawned engine process has
signal.signal(signal.SIGUSR1, lambda *a: (child and os.kill(child, signal.SIGUSR1), tell(area)))
tell(area)
if child:
    print("ready", flush=True)
while True:
    time.sleep(60)
"""


def digests(log: Path, count: int, timeout: float = 120) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        found = {int(w[1]): w[2] for w in (line.split() for line in log.read_text().splitlines()) if len(w) == 3 and w[0] == "digest"}
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise SystemExit("the restored holder did not answer: %s" % log.read_text()[-500:])
        time.sleep(0.05)


def restore_once(image, pristine: Path, work: Path, threads: int, *, verify: dict[int, str] | None) -> dict[str, float]:
    images = work / "images"
    shutil.rmtree(images, ignore_errors=True)
    shutil.copytree(pristine, images, copy_function=os.link)  # the split and CRIU replace files, never write into them
    out: dict[str, float] = {}
    if threads:
        out["split"] = page_fill.split_for_fill(images).seconds
    log = work / ("restored-%d.log" % threads)
    log.unlink(missing_ok=True)
    measured: dict = {}
    with settings.using(settings.current().replace(page_fill_threads=threads)):
        t = time.monotonic()
        pid, _ = criu_tree.restore(Criu.locate(), image, images, log_path=log, progress=lambda m: None, details=measured)
        out["total"] = time.monotonic() - t
    try:
        out["criu"] = measured["criu_restore_seconds"]
        if "page_fill" in measured:
            out["fill"], out["fill_bytes"] = measured["page_fill"]["seconds"], measured["page_fill"]["bytes"]
        if verify is not None:
            os.kill(pid, signal.SIGUSR1)
            got = digests(log, len(verify))
            if got != verify:
                raise SystemExit("restored memory differs (threads %d): %s, dumped %s" % (threads, got, verify))
    finally:
        kill_tree(pid, grace=2.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="non-zero private memory of the holder")
    ap.add_argument("--child-mib", type=int, default=0, help="a child's own non-zero private memory (0: no child)")
    ap.add_argument("--threads", default="1,2", help="thread counts to fill with, comma-separated")
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    modes = [0] + [int(t) for t in args.threads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="page-fill-probe-", dir="/dev/shm"))
    try:
        log = work / "holder.log"
        cmd = "%s -c %s %d %d" % (sys.executable, _quoted(HOLDER), args.mib, args.child_mib)
        unit = start_unit(cmd, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, log_path=log)
        deadline = time.monotonic() + 600
        while "digest" not in log.read_text() or (args.child_mib and "ready" not in log.read_text()):
            if not unit.alive() or time.monotonic() > deadline:
                raise SystemExit("the holder did not start: %s" % log.read_text()[-500:])
            time.sleep(0.1)
        dumped = digests(log, 2 if args.child_mib else 1)
        t = time.monotonic()
        image = criu_tree.dump(Criu.locate(), unit.root_pid, work / "pristine", unit="probe", host="localhost", driver="probe", progress=lambda m: None)
        unit.reap()
        print("dumped %d MiB (+%d MiB child) in %.2f s; %d CPUs" % (args.mib, args.child_mib, time.monotonic() - t, os.cpu_count() or 0), flush=True)
        runs: dict[int, list[dict[str, float]]] = {m: [] for m in modes}
        for sample in range(args.samples):
            for mode in modes:
                runs[mode].append(restore_once(image, work / "pristine", work, mode, verify=dumped if sample == 0 else None))
        print("%-14s %8s %8s %8s %8s %10s" % ("mode", "criu s", "fill s", "total s", "split s", "fill GB/s"))
        for mode in modes:
            med = {k: statistics.median(r.get(k, 0.0) for r in runs[mode]) for k in ("criu", "fill", "total", "split", "fill_bytes")}
            rate = med["fill_bytes"] / med["fill"] / 1e9 if med["fill"] else 0.0
            name = "criu alone" if not mode else "fill, %d thr" % mode
            print("%-14s %8.3f %8.3f %8.3f %8.3f %10.2f" % (name, med["criu"], med["fill"], med["total"], med["split"], rate))
        print("(medians of %d; bytes identical after restore in every mode)" % args.samples)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


if __name__ == "__main__":
    sys.exit(main())
