"""The diagnostic that samples where a command's processes wait in the kernel
(benchmarks/gpu/kernel_waits.py): run around real direct reads of a file, then compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "kernel_waits.py"


def test_direct_reads_are_seen_blocked_and_compared_by_role(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(64 << 20))
    reader = "import os,sys\nfd=os.open(sys.argv[1], os.O_RDONLY|os.O_DIRECT)\nimport mmap\nb=mmap.mmap(-1, 4096)\nfor _ in range(3):\n    for off in range(0, 64<<20, 4096): os.preadv(fd, [b], off)\n"
    out = tmp_path / "waits.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "run", "--every", "0.002", "--out", str(out), "--", sys.executable, "-c", reader, str(data)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert set(doc["vmstat_delta"]) >= {"pgmajfault", "compact_stall"}
    blocked = [r for r in doc["timeline"] if r[4] == "D" and "__iomap_dio_rw" in r[5]]
    assert blocked, doc["busiest"][:5]
    pid = blocked[0][1]
    assert str(data) in doc["cmdlines"][pid]
    summary = tmp_path / "compare"
    done = subprocess.run([sys.executable, str(SCRIPT), "compare", "--out", str(summary), "--run", "one=%s" % out, "--role", "one:%s=the reader" % pid], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(summary.with_suffix(".json").read_text())["blocked"]["one"]
    mine = [r for r in rows if r["role"] == "the reader" and r["kind"] == "direct read"]
    assert mine and mine[0]["seconds"] > 0 and mine[0]["pid"] == int(pid)
    assert summary.with_suffix(".png").stat().st_size > 0
