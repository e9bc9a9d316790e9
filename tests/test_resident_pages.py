"""Which parts of its mapped files a tree has in memory (host/resident_pages.py), recorded at
capture, and preparation reading only those (weights/page_cache.py)."""

from __future__ import annotations

import subprocess
import sys

from sparkrun_coldsnap.host import file_drift, resident_pages
from sparkrun_coldsnap.weights import page_cache

MIB = 1 << 20

# A process that maps a 16 MiB file and reads one byte at 0 and one at 9 MiB, then waits.
TOUCH = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    _ = m[0] + m[9 << 20]
    print("ready", flush=True)
    time.sleep(60)
"""


def test_the_ranges_a_process_touched_are_recorded_and_the_rest_is_not(tmp_path):
    data = tmp_path / "lib.so"
    data.write_bytes(bytes(range(256)) * (16 * MIB // 256))
    child = subprocess.Popen([sys.executable, "-c", TOUCH, str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        ranges = resident_pages.resident_ranges([child.pid])[str(data)]
        recorded = {f.path: f for f in file_drift.record([child.pid])}[str(data)]
    finally:
        child.kill()
        child.wait()
    covered = sum(n for _, n in ranges)
    assert any(a <= 0 < a + n for a, n in ranges) and any(a <= 9 * MIB < a + n for a, n in ranges), ranges
    # the kernel maps neighbours of a touched page in with it (a few pages, or a large folio of
    # up to 2 MiB), never the untouched parts of the file
    assert covered <= 4 * MIB and not any(a <= at < a + n for a, n in ranges for at in (4 * MIB, 14 * MIB)), ranges
    assert recorded.resident == tuple(ranges)


# A process that maps a 16 MiB file privately and writes one byte at 5 MiB: that page becomes
# its private copy, which CRIU dumps and whose restore reads the file's page first.
COPY = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    m[5 << 20] = 7
    print("ready", flush=True)
    time.sleep(60)
"""


def test_a_private_copy_of_a_file_page_is_recorded_with_the_file(tmp_path):
    data = tmp_path / "lib.so"
    data.write_bytes(b"\1" * (16 * MIB))
    child = subprocess.Popen([sys.executable, "-c", COPY, str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        ranges = resident_pages.resident_ranges([child.pid])[str(data)]
    finally:
        child.kill()
        child.wait()
    assert any(a <= 5 * MIB < a + n for a, n in ranges), ranges
    assert sum(n for _, n in ranges) <= 4 * MIB and not any(a <= 12 * MIB < a + n for a, n in ranges), ranges


def test_many_ranges_are_joined_into_few():
    ranges = [(i * 3 * MIB, 4096) for i in range(1000)]
    joined = resident_pages.join(ranges, gap=4096, most=100)
    assert len(joined) <= 100
    assert joined[0][0] == 0 and joined[-1][0] + joined[-1][1] == ranges[-1][0] + 4096
    assert resident_pages.join([(0, 4096), (8192, 4096), (10 * MIB, 4096)], gap=4096) == [(0, 12288), (10 * MIB, 4096)]


def test_preparation_reads_only_the_recorded_ranges_of_a_file(tmp_path):
    data = tmp_path / "lib.so"
    data.write_bytes(b"\1" * (8 * MIB))
    spans = {data: [(MIB, MIB), (6 * MIB, 4 * MIB)]}  # the second runs past the end of the file
    assert page_cache.span_bytes([data], spans) == 3 * MIB
    ticks: list[int] = []
    assert page_cache.read_ahead([data], ticks.append, spans) == 3 * MIB == sum(ticks)
    assert page_cache.read_ahead([data]) == 8 * MIB


def test_a_file_recorded_before_ranges_were_is_read_whole():
    recorded = file_drift.RecordedFile(path="/x", size=1, mtime_ns=1)
    assert recorded.resident is None
