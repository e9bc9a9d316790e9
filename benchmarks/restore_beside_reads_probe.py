"""Does `criu restore` wait behind a large read of the disk that runs beside it?

On a GPU node with nothing prepared, the restore runs while the weights' payload is copied
into memory: sixteen threads with a 16 MiB direct read each in flight, the disk busy at its
full rate. There `criu restore` took 5.7-6.5 s where it takes about 1 s alone, with a single
major fault, so it was not its own code it waited for. This probe asks whether the same
happens on this machine, and where CRIU waits:

- it starts the embedded default's engine (the tiny CPU vLLM, the recipe's own command),
  lets it answer once, and dumps it with the project's CRIU driver into memory, as a
  restore's preparation stages the images;
- then restores it, in turn, alone and beside a reader that reads a large file as the copy
  does (READERS threads, 16 MiB direct reads), each without and with CRIU's record of the
  kernel's features at /run/criu.kdat (criu/kdat.py); page cache dropped before each,
  then the files the tree maps and CRIU's own files read back, as preparation does; the
  memory fill planned as the GPU drivers plan it;
- prints `criu restore`'s median in each case, the reader's rate, and, from CRIU's own log at
  level 4, the longest waits between two lines of the slowest restore beside the reads
  without the record.

Run as root on the embedded default (after `bash scripts/setup.sh`), holding the engine lock
the test suite uses; it leaves the record made (``--out`` writes the samples and a plot):

    flock /tmp/coldsnap-engine.lock .venv/bin/python benchmarks/restore_beside_reads_probe.py --samples 3 --file-gib 4 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkrun_coldsnap.criu import kdat as criu_kdat  # noqa: E402
from sparkrun_coldsnap.criu import page_fill  # noqa: E402
from sparkrun_coldsnap.criu import tool as criu_tool  # noqa: E402
from sparkrun_coldsnap.criu import tree as criu_tree  # noqa: E402
from sparkrun_coldsnap.criu.tool import Criu  # noqa: E402
from sparkrun_coldsnap.host.iouring import io_uring_disabled  # noqa: E402
from sparkrun_coldsnap.host.process_tree import kill_tree, mapped_paths, tree_pids  # noqa: E402
from sparkrun_coldsnap.launch.engine_env import EngineEnv  # noqa: E402
from sparkrun_coldsnap.weights.page_cache import drop, read_ahead  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-vllm-cpu.yaml"
PIECE = 16 << 20
READERS = 16
TIMESTAMP = re.compile(r"^\((\d+)\.(\d+)\)")

# The copy's reads: every thread has one direct read of a piece in flight, over the file again
# and again, until it is told to stop; prints the bytes per second it read.
READER = r"""
import mmap, os, signal, sys, threading, time
path, threads, piece = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
pieces = os.fstat(fd).st_size // piece
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
done = [0] * threads
def read(k):
    buf = mmap.mmap(-1, piece)
    i = k
    while not stop.is_set():
        done[k] += os.preadv(fd, [buf], (i % pieces) * piece)
        i += threads
t = time.monotonic()
workers = [threading.Thread(target=read, args=(k,)) for k in range(threads)]
for w in workers:
    w.start()
print("reading", flush=True)
while not stop.is_set():
    stop.wait(0.1)
for w in workers:
    w.join()
print(sum(done) / (time.monotonic() - t), flush=True)
"""


def capture_request() -> dict:
    """The capture request the recipe makes on the default cluster (its engine's command and environment)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPARKRUN_NO_TELEMETRY": "1"}
    cp = subprocess.run(
        [str(Path(sys.executable).parent / "sparkrun-coldsnap"), "capture", str(RECIPE), "--cluster", "coldsnap-local", "--dry-run"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(cp.stdout)


def start_engine(req: dict, log: Path) -> subprocess.Popen:
    w = req["workload"]
    env = {**os.environ, **w["launch"]["env"], "HF_HUB_OFFLINE": "1"}
    if w["launch"].get("engine_env"):
        env = EngineEnv.named(w["launch"]["engine_env"]).apply(env)  # its bin first on PATH, as a launch does
    with open(log, "ab") as out:
        proc = subprocess.Popen(["bash", "-c", "exec " + w["launch"]["command"]], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True)
    url = "http://127.0.0.1:%d" % w["launch"]["port"]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v1/models", timeout=2).ok:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise SystemExit("the engine ended (exit %s): see %s" % (proc.returncode, log))
        time.sleep(1)
    body = {"model": w["model"]["id"], "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    requests.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    return proc


def mapped_files(root_pid: int) -> list[Path]:
    """Regular files the tree maps: what preparation reads back into the page cache."""
    out = {Path(p.split(" (deleted)")[0]) for pid in tree_pids(root_pid) for p in mapped_paths(pid)}
    return sorted(p for p in out if not str(p).startswith(("/dev/", "/proc/", "/sys/")) and p.is_file())


def make_file(path: Path, gib: int) -> None:
    if path.exists() and path.stat().st_size >= gib << 30:
        return
    block = os.urandom(PIECE)
    with open(path, "wb") as f:
        for _ in range((gib << 30) // PIECE):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def restore_once(criu: Criu, unit, pristine: Path, files: list[Path], big: Path | None, record: bool, log_dir: Path, tag: str) -> tuple[float, float | None, Path]:
    staged = Path(tempfile.mkdtemp(prefix="probe-images-", dir="/dev/shm"))
    shutil.copytree(pristine, staged, dirs_exist_ok=True)
    page_fill.split_for_fill(staged)
    if record:
        criu_kdat.ensure(criu)
    else:
        criu_kdat.KDAT.unlink(missing_ok=True)
    drop()
    read_ahead(files + list(criu_tool.program_files()) + ([criu_kdat.KDAT] if record else []))
    reader = None
    if big is not None:
        reader = subprocess.Popen([sys.executable, "-c", READER, str(big), str(READERS), str(PIECE)], stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None
        reader.stdout.readline()
        time.sleep(0.5)  # the disk's queue full, as when the copy has been going a while
    details: dict = {}
    try:
        root, _ = criu_tree.restore(criu, unit, staged, log_path=log_dir / ("engine-%s.log" % tag), progress=lambda m: None, extra_args=("-v4",), details=details)
        kill_tree(root, grace=2.0)
    finally:
        rate = None
        if reader is not None:
            reader.send_signal(signal.SIGTERM)
            out, _ = reader.communicate(timeout=60)
            rate = float(out.split()[-1])
        log = log_dir / ("restore-%s.log" % tag)
        shutil.copy(staged / criu_tree.RESTORE_LOG, log)
        shutil.rmtree(staged, ignore_errors=True)
    return float(details["criu_restore_seconds"]), rate, log


def longest_waits(log: Path, count: int = 12) -> list[tuple[float, str, str]]:
    """The longest gaps between two timestamped lines of a CRIU log: (seconds, line before, line after)."""
    lines = []
    for text in log.read_text(errors="replace").splitlines():
        m = TIMESTAMP.match(text)
        if m:
            lines.append((int(m.group(1)) + int(m.group(2)) / 1e6, text))
    gaps = [(b[0] - a[0], a[1][:160], b[1][:160]) for a, b in zip(lines, lines[1:])]
    return sorted(gaps, reverse=True)[:count]


def _home(line: str) -> str:
    return line.replace(str(Path.home()), "~")


def write_results(out: Path, took: dict[str, list[float]], rate: float, waits: list[tuple[float, str, str]]) -> None:
    """The samples as JSON and the medians as bars, log-scaled: the cases differ fiftyfold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "what": "criu restore of the tiny CPU vLLM, alone and beside a 16-thread direct read of the disk, without and with CRIU's record of the kernel's features (and its plugin folder listed, its PID file in memory)",
        "reader_bytes_per_second": rate,
        "seconds": took,
        "medians": {k: statistics.median(v) for k, v in took.items()},
        "longest_waits_without_record": [{"seconds": g, "after": _home(a), "then": _home(b)} for g, a, b in waits],
    }
    (out / "restore-beside-reads.json").write_text(json.dumps(doc, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(took)
    medians = [statistics.median(took[n]) for n in names]
    ax.barh(names, medians, color=["#999999", "#cc4444", "#999999", "#4477aa"])
    for y, v in enumerate(medians):
        ax.text(v, y, " %.3f s" % v, va="center")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("criu restore, seconds (median, log scale)")
    ax.set_title("beside a direct read of the disk at %.1f GB/s" % (rate / 1e9))
    fig.tight_layout()
    fig.savefig(out / "restore-beside-reads.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--file-gib", type=int, default=4, help="size of the file read beside the restore (on the disk the engine's files are on)")
    ap.add_argument("--file", type=Path, default=Path("/var/tmp/coldsnap-probe-reads.bin"))
    ap.add_argument("--keep", type=Path, default=None, help="a folder to keep CRIU's logs in")
    ap.add_argument("--out", type=Path, default=None, help="a folder for the results (restore-beside-reads.json and .png)")
    args = ap.parse_args()
    criu = Criu.locate()
    req = capture_request()
    work = Path(tempfile.mkdtemp(prefix="restore-probe-"))
    log_dir = args.keep or work
    log_dir.mkdir(parents=True, exist_ok=True)
    pristine = Path(tempfile.mkdtemp(prefix="probe-pristine-", dir="/dev/shm"))
    print("making the %d GiB file the reader reads: %s" % (args.file_gib, args.file), flush=True)
    make_file(args.file, args.file_gib)
    try:
        print("starting the tiny CPU vLLM and dumping it", flush=True)
        with io_uring_disabled():
            engine = start_engine(req, work / "engine.log")
            files = mapped_files(engine.pid)
            unit = criu_tree.dump(criu, engine.pid, pristine, unit="solo", host="localhost", driver="cpu", progress=lambda m: None)
            engine.wait()  # reaped: the restore needs its PID back
        print("%d files mapped (%.2f GB); images %.2f GB" % (len(files), sum(f.stat().st_size for f in files) / 1e9, sum(p.stat().st_size for p in pristine.rglob("*") if p.is_file()) / 1e9), flush=True)
        cases = [("alone", None, False), ("beside", args.file, False), ("alone, record", None, True), ("beside, record", args.file, True)]
        took: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        rates: list[float] = []
        logs: list[tuple[float, Path]] = []
        for i in range(args.samples):
            for name, big, record in cases:
                s, rate, log = restore_once(criu, unit, pristine, files, big, record, log_dir, "%s-%d" % (name.replace(", ", "-"), i))
                took[name].append(s)
                if rate:
                    rates.append(rate)
                if name == "beside":
                    logs.append((s, log))
            print("sample %d: criu restore %s" % (i + 1, ", ".join("%s %.3f s" % (name, took[name][-1]) for name, _, _ in cases)), flush=True)
        print("criu restore, medians of %d (the reader at %.2f GB/s):" % (args.samples, statistics.median(rates) / 1e9))
        for name, _, _ in cases:
            print("  %-16s %.3f s" % (name, statistics.median(took[name])))
        if args.out is not None:
            write_results(args.out, took, statistics.median(rates), longest_waits(max(logs)[1]))
        slowest = max(logs)[1]
        print("longest waits in %s (beside the reads, no record):" % slowest.name)
        for gap, before, after in longest_waits(slowest):
            print("  %.3f s after: %s\n           then: %s" % (gap, before, after))
        return 0
    finally:
        shutil.rmtree(pristine, ignore_errors=True)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
