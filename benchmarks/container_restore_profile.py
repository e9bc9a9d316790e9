"""Where a restore into a new container spends its time: dockerd, containerd, runc, CRIU.

Prepares a restore of RECIPE's capsule through the plugin (as `sparkrun run` does before
eviction), then activates it while watching the host:

* every 20 ms, which of the runtime's processes exist and how much CPU each has used
  (dockerd, containerd, the shim, runc, CRIU and the tar/gzip CRIU runs), and the size of
  containerd's ingest directory (the checkpoint on its way into the content store) and of
  its ``ctrd-checkpoint*`` directories (the checkpoint unpacked for runc);
* optionally ``perf record`` of the whole machine over the same window, reported by
  command and by function (``--perf``).

The timeline it prints is read off those samples: when the content store starts and stops
growing, when the unpacked copy appears and stops growing, when CRIU runs, and when the
first token comes. Run it as root on the machine with the daemon:

    sudo .venv/bin/python benchmarks/container_restore_profile.py recipes/tiny-vllm-cpu-docker.yaml -H localhost --out OUT [--perf]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparkrun_coldsnap import api  # noqa: E402
from sparkrun_coldsnap.bench import ensure_capsule  # noqa: E402
from sparkrun_coldsnap.cli.common import open_store, parse_overrides  # noqa: E402
from sparkrun_coldsnap.host import paths  # noqa: E402
from sparkrun_coldsnap.integration import placement, planning  # noqa: E402
from sparkrun_coldsnap.launch import checkpoint_leftovers  # noqa: E402
from sparkrun_coldsnap.launch import docker as docker_unit  # noqa: E402
from sparkrun_coldsnap.progress import Progress  # noqa: E402
from sparkrun_coldsnap.weights.page_cache import drop as drop_page_cache  # noqa: E402

TICK = 0.02
CLK = os.sysconf("SC_CLK_TCK")
LAZY_IMAGES = ""  # the prepared container's images: its lazy-pages daemon serves them


def component(pid: str) -> str | None:
    """Which part of the runtime a process belongs to (None: not one of them)."""
    try:
        comm = Path("/proc/%s/comm" % pid).read_text().strip()
        cmd = Path("/proc/%s/cmdline" % pid).read_bytes().split(b"\0")
    except OSError:
        return None
    line = b" ".join(cmd)
    # runc drives CRIU over its RPC socket (``criu swrk``); other CRIU runs on the host
    # (a host-process restore elsewhere) are not this restore's.
    if b"criu" in line and b"swrk" in line:
        return "criu"
    if b"criu" in line and b"lazy-pages" in line and b"-D" in cmd and LAZY_IMAGES and LAZY_IMAGES.encode() in line:
        return "criu lazy-pages daemon"
    if comm in ("dockerd", "containerd", "runc", "docker"):
        return comm
    if comm.startswith("containerd-shim"):
        return "containerd-shim"
    if comm in ("tar", "gzip") and _parent_is_criu(pid):
        return "tar/gzip (CRIU's tmpfs restore)"
    return None


def _parent_is_criu(pid: str) -> bool:
    try:
        ppid = Path("/proc/%s/stat" % pid).read_text().rsplit(")", 1)[1].split()[1]
        return b"swrk" in Path("/proc/%s/cmdline" % ppid).read_bytes()
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: str) -> float:
    try:
        fields = Path("/proc/%s/stat" % pid).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


class Watcher:
    """Samples the runtime's processes and containerd's directories until stopped."""

    def __init__(self, ingest: Path, temp_dirs: set[Path]) -> None:
        self.ingest, self.temp_dirs = ingest, temp_dirs
        self.samples: list[dict] = []
        self.cpu_first: dict[str, float] = {}  # pid -> CPU seconds when first seen
        self.cpu_last: dict[str, tuple[str, float]] = {}  # pid -> (component, CPU seconds when last seen)
        self.baseline = {pid: cpu_seconds(pid) for pid in os.listdir("/proc") if pid.isdigit()}
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self.t0
            present: dict[str, int] = {}
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                c = component(pid)
                if c is None:
                    continue
                present[c] = present.get(c, 0) + 1
                self.cpu_last[pid] = (c, cpu_seconds(pid))
            copies = [d for parent in self.temp_dirs for d in parent.glob(checkpoint_leftovers.PREFIX + "*")]
            self.samples.append(
                {
                    "t": round(now, 3),
                    "processes": present,
                    "ingest_bytes": tree_bytes(self.ingest) if self.ingest.exists() else 0,
                    "unpacked_bytes": sum(tree_bytes(d) for d in copies),
                    "unpacked_dirs": len(copies),
                }
            )
            time.sleep(TICK)

    def cpu_by_component(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (c, last) in self.cpu_last.items():
            out[c] = out.get(c, 0.0) + last - self.baseline.get(pid, 0.0)
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def first(samples: list[dict], pred) -> float | None:
    return next((s["t"] for s in samples if pred(s)), None)


def last(samples: list[dict], pred) -> float | None:
    hits = [s["t"] for s in samples if pred(s)]
    return hits[-1] if hits else None


def timeline(samples: list[dict]) -> dict[str, float | None]:
    """Moments read off the samples (seconds after the activation began)."""
    peak_ingest = max((s["ingest_bytes"] for s in samples), default=0)
    peak_unpacked = max((s["unpacked_bytes"] for s in samples), default=0)
    return {
        "content_store_write_first": first(samples, lambda s: s["ingest_bytes"] > 0),
        "content_store_write_last": last(samples, lambda s: s["ingest_bytes"] > 0),
        "content_store_peak_bytes": peak_ingest,
        "unpacked_copy_appears": first(samples, lambda s: s["unpacked_dirs"] > 0),
        "unpacked_copy_complete": first(samples, lambda s: peak_unpacked and s["unpacked_bytes"] >= peak_unpacked),
        "unpacked_copy_peak_bytes": peak_unpacked,
        "criu_first": first(samples, lambda s: "criu" in s["processes"]),
        "criu_last": last(samples, lambda s: "criu" in s["processes"]),
        "runc_first": first(samples, lambda s: "runc" in s["processes"]),
        "runc_last": last(samples, lambda s: "runc" in s["processes"]),
    }


def perf_report(data: Path, out: Path) -> None:
    """Where the machine's CPU went, by command and by function (top of each)."""
    for name, sort in (("perf-by-command.txt", "comm"), ("perf-by-function.txt", "comm,dso,symbol")):
        argv = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none", "--sort", sort, "--percent-limit", "0.3"]
        text = subprocess.run(argv, capture_output=True, text=True).stdout
        (out / name).write_text(tidy_perf(text))


def tidy_perf(text: str) -> str:
    """perf's table without its padding and the empty branch columns at the end of each line."""
    lines = (re.sub(r"(\s+-)+\s*$", "", line).rstrip() for line in text.splitlines())
    return "\n".join(re.sub(r" {3,}", "  ", line) for line in lines if line and not line.startswith("#")) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("-H", "--hosts", default="localhost")
    ap.add_argument("-o", "--option", dest="options", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--perf", action="store_true", help="also perf-record the whole machine over the activation")
    ap.add_argument("--out", type=Path, default=Path("profile-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    doc_recipe = __import__("yaml").safe_load(Path(args.recipe).read_text())
    store = open_store(args.store, doc_recipe)
    actx = planning.plan_activation(args.recipe, hosts=tuple(args.hosts.split(",")), cluster=None, overrides=parse_overrides(tuple(args.options)), offline=None)
    req = placement.restore_request(actx)
    if not ensure_capsule(store, req.capsule.ref):
        progress.step("no capsule %s yet: capturing it first" % req.capsule.ref)
        api.capture(placement.capture_request(actx), store=store, progress=progress)

    drop_page_cache()
    prepared = api.prepare_restore(req, store=store, progress=progress)
    global LAZY_IMAGES
    LAZY_IMAGES = str(getattr(getattr(getattr(prepared.units, "staged", None), "container", None), "images", "") or "")
    root = Path(docker_unit.info()["root_dir"])
    ingest = root / "containerd" / "daemon" / "io.containerd.content.v1.content" / "ingest"
    watcher = Watcher(ingest, checkpoint_leftovers.containerd_temp_dirs())
    perf = None
    if args.perf:
        perf = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "499", "-o", str(args.out / "perf.data")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf is recording before the clock starts
    watcher.start()
    outcome = None
    try:
        outcome = api.activate_restore(prepared, log_path=paths.run_dir() / "logs" / "profile-restore.log", progress=progress)
    finally:
        watcher.stop()
        if perf is not None:
            perf.send_signal(2)
            perf.wait()
        if outcome is not None:
            outcome.unit.stop()
    phases = {p.name: round(p.seconds, 3) for p in outcome.receipt.phases}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "runtime": docker_unit.runtime_summary(),
        "recipe": args.recipe,
        "capsule": req.capsule.ref,
        "ttft_seconds": outcome.ttft_seconds,
        "prepare_seconds": round(prepared.prepare_seconds, 3),
        "phases": phases,
        "restore_steps": dict(getattr(outcome.unit, "steps", {}) or {}),
        # The memory fill after CRIU (a restore without memory on demand), from the receipt.
        "page_fill": outcome.receipt.details.get("page_fill"),
        "page_fill_split": (outcome.receipt.details.get("staged_images") or {}).get("page_fill_split"),
        "timeline": timeline(watcher.samples),
        "cpu_seconds": watcher.cpu_by_component(),
        "samples": watcher.samples,
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    if perf is not None:
        perf_report(args.out / "perf.data", args.out)
        (args.out / "perf.data").unlink(missing_ok=True)
    print("restore steps: %s" % ", ".join("%s %.3fs" % kv for kv in result["restore_steps"].items()))
    if result["page_fill"]:
        print("page fill: %s" % result["page_fill"])
    t = result["timeline"]
    print("first token %.2f s after the activation began; phases: %s" % (outcome.ttft_seconds or 0, ", ".join("%s %.2fs" % kv for kv in phases.items())))
    for k, v in t.items():
        print("  %-28s %s" % (k, v))
    print("CPU seconds during the activation: %s" % ", ".join("%s %.2f" % kv for kv in result["cpu_seconds"].items()))
    print("results: %s" % (args.out / "profile.json"))


if __name__ == "__main__":
    main()
