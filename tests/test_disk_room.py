"""The room check before a dump: the estimate from smaps_rollup, and the one-line refusal."""

from __future__ import annotations

from sparkrun_coldsnap.host import disk_room

ROLLUP = """55ba5cfe2000-7ffd9bd36000 ---p 00000000 00:00 0                          [rollup]
Rss:              900000 kB
Pss:              700000 kB
Pss_Anon:         400000 kB
Pss_File:         200000 kB
Pss_Shmem:        100000 kB
Anonymous:        400000 kB
Swap:               5000 kB
SwapPss:            2000 kB
"""


def test_the_estimate_counts_anonymous_shared_memory_and_swapped_pages(tmp_path):
    for pid in (10, 11):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "smaps_rollup").write_text(ROLLUP)
    # File pages are not written by a dump; a process gone meanwhile counts nothing.
    assert disk_room.dump_estimate([10, 11, 12], proc=tmp_path) == 2 * (400000 + 100000 + 2000) * 1024


def test_shortfall_names_the_place_and_the_numbers(tmp_path):
    assert disk_room.shortfall(1 << 20, [(tmp_path / "not" / "yet", 2.0, "the images")]) is None
    line = disk_room.shortfall(10**18, [(tmp_path, 1.0, "fine"), (tmp_path / "later", 2.0, "the images")])
    assert line.startswith("not enough disk space for the capture: fine needs about 1000000000.0 GB in %s, " % tmp_path)
    assert line.endswith("GB are free there")
