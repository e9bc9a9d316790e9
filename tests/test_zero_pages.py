"""Zero pages left out of real CRIU dumps: what comes back is byte for byte what was dumped.

The workload (tests/workloads/memory_pattern.py) has zero pages CRIU dumps and the rewrite
may leave out, zero pages of a child where its parent has data (CRIU must not hand the
child its parent's page), and zeros written over a private file mapping (left out, the
file's bytes would come back). Restored with every page copied first and with memory on
demand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from registry_fixtures import free_port

from sparkrun_coldsnap.criu import image_contents, zero_pages
from sparkrun_coldsnap.criu import images as img
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids
from sparkrun_coldsnap.launch.local import start_unit

WORKLOAD = Path(__file__).parent / "workloads" / "memory_pattern.py"
PAGES = 2048


def digest(port: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return requests.get("http://127.0.0.1:%d/digest" % port, timeout=5).json()
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def dumped(criu, tmp_path):
    """The workload dumped (it stops), with the digests it answered just before."""
    return dump_pattern(tmp_path, PAGES)


def dump_pattern(tmp_path: Path, pages: int, *, stopped: bool = False) -> tuple[Path, UnitImage, int, dict]:
    """The workload with an area of *pages* pages, dumped into ``tmp_path/images`` (it stops):
    the images, what the dump recorded, its port, and the digests it answered just before.
    *stopped*: every process stopped before the dump, as a unit at a cut across hosts is."""
    port = free_port()
    log = tmp_path / "workload.log"
    unit = start_unit("%s %s --port %d --file %s --pages %d" % (sys.executable, WORKLOAD, port, tmp_path / "mapped.bin", pages), env={"PATH": "/usr/bin:/bin"}, log_path=log)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text():
            assert unit.alive() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        before = digest(port)
        if stopped:
            for p in tree_pids(unit.root_pid):
                os.kill(p, signal.SIGSTOP)
        image = CpuDriver().checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
    except BaseException:
        kill_tree(unit.root_pid)
        raise
    unit.reap()
    return tmp_path / "images", image, port, before


def continues_as_dumped(pid: int, port: int, before: dict) -> None:
    """The tree restored at *pid* stays stopped, as it was dumped, until it is continued; then
    it answers as it did before the dump."""
    pids = tree_pids(pid)
    time.sleep(0.3)
    assert len(pids) >= 2 and {psutil.Process(p).status() for p in pids} == {psutil.STATUS_STOPPED}
    for p in pids:
        os.kill(p, signal.SIGCONT)
    assert digest(port) == before


def pages_listed(images: Path) -> dict[str, int]:
    out = {}
    for p in images.glob("pagemap-*.img"):
        entries = img.ImageFile.read(p, img.PAGEMAP_MAGIC).entries[1:]
        out[p.name] = sum(img.entry_pages(e) for e in map(lambda raw: img.parse("PagemapEntry", raw), entries) if e.flags & img.PE_PRESENT)
    return out


@pytest.mark.parametrize("lazy", [False, True], ids=["pages-copied", "on-demand"])
def test_zero_pages_left_out_and_every_byte_comes_back(dumped, lazy, tmp_path):
    images, image, port, before = dumped
    listed_before = pages_listed(images)
    report = zero_pages.leave_out_zero_pages(images)
    assert report.skipped == [] and report.processes >= 2
    # The anonymous area alone has two thirds zeros in the parent and half in the child.
    assert report.pages_left_out >= PAGES * 2 // 3 + PAGES // 2 - 64, report
    assert report.bytes_before - report.bytes_after == report.pages_left_out * img.PAGE
    assert sum(pages_listed(images).values()) == sum(listed_before.values()) - report.pages_left_out
    with settings.using(settings.current().replace(lazy_pages=lazy)):
        pid = CpuDriver().restore(image, images, log_path=tmp_path / "restore.log", progress=lambda m: None).root_pid
    try:
        assert digest(port) == before
    finally:
        kill_tree(pid)


def test_the_rewrite_is_needed_for_the_count_and_keeps_every_other_page(dumped, tmp_path):
    """The zero pages of a private file mapping stay: left out, the file's bytes come back."""
    images, image, port, before = dumped
    kept = tmp_path / "kept"
    shutil.copytree(images, kept)
    zero_pages.leave_out_zero_pages(images)
    # Each page listed now was listed before, at the same address with the same bytes.
    for name in pages_listed(images):
        assert pages_listed(images)[name] <= pages_listed(kept)[name]
    assert criu_tree.restore_problems(image) == []  # the captured PIDs are free again (zombies reaped)
    pid, _ = criu_tree.restore(Criu.locate(), image, images, log_path=tmp_path / "restore.log", progress=lambda m: None, lazy=False)
    try:
        after = digest(port)
    finally:
        kill_tree(pid)
    assert after == before
    assert json.dumps(after["parent"]["file"]) != json.dumps(after["parent"]["anon"])


def test_what_the_images_still_hold_is_told_area_by_area(dumped):
    images, _, _, _ = dumped
    zero_pages.leave_out_zero_pages(images)
    held = image_contents.held_by_area(images)
    assert "skipped" not in held and len(held["processes"]) >= 2
    listed = pages_listed(images)
    for proc in held["processes"]:
        # every byte a process's page map lists is counted once, in one of its areas
        assert proc["bytes"] == listed["pagemap-%d.img" % proc["pid"]] * img.PAGE == sum(proc["by_kind"].values()) + proc.get("outside_areas", 0)
        assert [a["bytes"] for a in proc["largest"]] == sorted((a["bytes"] for a in proc["largest"]), reverse=True)
        assert all(0 < a["bytes"] <= a["size"] for a in proc["largest"])  # an entry across two areas is split between them
    assert [p["bytes"] for p in held["processes"]] == sorted((p["bytes"] for p in held["processes"]), reverse=True)
    # The parent's pattern area: PAGES pages, one in three kept (the data), anonymous and writable.
    area = [a for p in held["processes"] for a in p["largest"] if a["size"] == PAGES * img.PAGE]
    assert any(a["kind"] == "anonymous" and a["prot"] == "rw-" and a["bytes"] == (PAGES + 2) // 3 * img.PAGE for a in area), area
    # The zeros written over the private file mapping stay, as file pages a process wrote to.
    assert any(p["by_kind"].get("file, private", 0) >= 4 * img.PAGE for p in held["processes"])


def test_an_image_it_cannot_read_is_left_as_it_is(dumped):
    images, _, _, _ = dumped
    victim = sorted(images.glob("pagemap-*.img"))[0]
    victim.write_bytes(b"\0" * 12)
    untouched = {p.name: p.read_bytes() for p in images.glob("pages-*.img")}
    report = zero_pages.leave_out_zero_pages(images)
    assert any(victim.name in s for s in report.skipped), report.skipped
    assert report.processes >= 1  # the others were still rewritten
    assert len(untouched) >= 2
