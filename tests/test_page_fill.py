"""Big private memory areas taken out of real CRIU dumps and written back by several threads
after CRIU restored the rest: what comes back is byte for byte what was dumped.

The workload (tests/workloads/memory_pattern.py) is the zero-page rewrite's: a parent with a
pattern area, a child that inherited it and changed some of its pages, and a private file
mapping (which stays with CRIU).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import psutil
import pytest
from test_zero_pages import PAGES, continues_as_dumped, digest, dump_pattern, pages_listed

from sparkrun_coldsnap.criu import images as img
from sparkrun_coldsnap.criu import page_fill, zero_pages
from sparkrun_coldsnap.criu import tree as criu_tree
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.drivers.n610 import N610Driver
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host.process_tree import inner_pid, kill_tree


def restore(image, images: Path, tmp_path: Path, *, lazy: bool = False, details: dict | None = None) -> int:
    assert criu_tree.restore_problems(image) == []
    pid, _ = criu_tree.restore(Criu.locate(), image, images, log_path=tmp_path / "restore.log", progress=lambda m: None, lazy=lazy, details=details)
    return pid


def pages_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


def contents(images: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in images.iterdir() if p.is_file()}


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.parametrize("zeros_left_out", [False, True], ids=["every-page-dumped", "zero-pages-left-out"])
def test_the_big_areas_move_out_of_the_images_and_every_byte_comes_back(criu, tmp_path, zeros_left_out):
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    if zeros_left_out:
        zero_pages.leave_out_zero_pages(images)
    listed, size = sum(pages_listed(images).values()), pages_bytes(images)
    report = page_fill.split_for_fill(images)
    assert report.skipped == [] and report.processes >= 2
    # Most of what was dumped is the pattern area, in the parent and in the child.
    assert report.bytes_moved >= size // 2 and report.bytes_moved + report.bytes_kept == size, report
    assert page_fill.planned_bytes(images) == report.bytes_moved
    assert pages_bytes(images) == size - report.bytes_moved
    assert sum(pages_listed(images).values()) * img.PAGE == listed * img.PAGE - report.bytes_moved
    assert len(page_fill.indexes(images)) >= 2
    measured: dict = {}
    # Memory on demand asked for: a split dump is restored with every page all the same.
    pid = restore(image, images, tmp_path, lazy=True, details=measured)
    try:
        assert digest(port) == before
    finally:
        kill_tree(pid)
    assert measured["page_fill"]["bytes"] == report.bytes_moved and measured["page_fill"]["processes"] >= 2
    assert measured["criu_restore_seconds"] > 0


def test_a_big_area_is_written_in_chunks_by_several_threads_at_once(criu, tmp_path, monkeypatch):
    pages = 16384  # 64 MiB in the parent and in the child
    images, image, port, before = dump_pattern(tmp_path, pages)
    report = page_fill.split_for_fill(images)
    assert report.bytes_moved >= 2 * pages * img.PAGE - (1 << 20)
    chunks: list[int] = []
    write = page_fill._write

    def watched(pid: int, base: int, runs: list) -> int:
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED  # CRIU left it stopped: nothing runs on zeros
        chunks.append(pid)
        return write(pid, base, runs)

    monkeypatch.setattr(page_fill, "_write", watched)
    measured: dict = {}
    with settings.using(settings.current().replace(page_fill_threads=4)):
        pid = restore(image, images, tmp_path, details=measured)
    try:
        assert digest(port) == before
    finally:
        kill_tree(pid)
    assert measured["page_fill"]["threads"] == 4
    # Each process's area is cut into several pieces, so the biggest one spreads over the threads.
    assert len(chunks) >= 4 and all(chunks.count(p) >= 2 for p in set(chunks)), chunks


@pytest.mark.parametrize("failing", ["new-page-map", "index"])
def test_a_split_that_fails_leaves_the_images_as_they_were(criu, tmp_path, monkeypatch, failing):
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    untouched = contents(images)
    if failing == "new-page-map":
        write_bytes = Path.write_bytes
        monkeypatch.setattr(Path, "write_bytes", lambda self, data: _no_space() if self.name.endswith(".img.fill") else write_bytes(self, data))
    else:  # the last step: the pages and the page map were already replaced
        replace = os.replace
        monkeypatch.setattr(page_fill.os, "replace", lambda src, dst: _no_space() if str(dst).endswith(".json") else replace(src, dst))
    report = page_fill.split_for_fill(images)
    monkeypatch.undo()
    assert len(report.skipped) >= 2 and all("No space left" in s for s in report.skipped), report.skipped
    assert report.bytes_moved == 0
    assert contents(images) == untouched  # nothing left behind, nothing changed
    pid = restore(image, images, tmp_path)
    try:
        assert digest(port) == before
    finally:
        kill_tree(pid)


def _no_space():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_fill_that_fails_ends_the_restored_tree_and_says_where(criu, tmp_path):
    images, image, _, _ = dump_pattern(tmp_path, PAGES)
    page_fill.split_for_fill(images)
    index = page_fill.index_path(images, image.root_pid)
    plan = json.loads(index.read_text())
    plan["runs"][0][0] = 0x1000  # an address nothing is mapped at
    index.write_text(json.dumps(plan))
    with pytest.raises(RestoreError) as err:
        restore(image, images, tmp_path)
    message = str(err.value)
    assert "\n" not in message and "pid %d at 0x1000" % image.root_pid in message and "Bad address" in message, message
    assert alive(image.pids) == []


def test_the_n610_driver_splits_during_preparation_unless_told_not_to(criu, tmp_path):
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    kept = tmp_path / "kept"
    shutil.copytree(images, kept)
    driver = N610Driver()
    for off in (settings.current().replace(page_fill_threads=0), settings.current().replace(n610_lazy_pages=True)):
        with settings.using(off):
            assert driver.stage_images(image, images) is None
        assert page_fill.indexes(images) == [] and contents(images) == contents(kept)
    with settings.using(settings.current().replace(page_fill_threads=2, n610_lazy_pages=False)):
        staged = driver.stage_images(image, images)
    assert staged is not None and staged["page_fill_split"]["bytes_moved"] > 0, staged
    # Staged again (a restore prepared twice from the same images): the split is not redone.
    assert page_fill.split_for_fill(images).bytes_moved == staged["page_fill_split"]["bytes_moved"]
    pid = restore(image, images, tmp_path)
    try:
        assert digest(port) == before
    finally:
        kill_tree(pid)


def test_a_unit_dumped_stopped_at_a_cut_across_hosts_is_filled_and_left_stopped(criu, tmp_path):
    """The coordinator continues every unit of such a workload at once, after every restore."""
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    page_fill.split_for_fill(images)
    peer = image.model_copy(update={"driver_data": DriverData(peer_connections=True)})
    pid = restore(peer, images, tmp_path)
    try:
        continues_as_dumped(pid, port, before)
    finally:
        kill_tree(pid)


def test_a_tree_restored_in_namespaces_of_its_own_is_filled_from_the_host(criu, tmp_path):
    """The cpu driver's restore: the fill finds each process by the PID the images name,
    its PID inside the namespace, not the host's."""
    images, image, port, before = dump_pattern(tmp_path, PAGES)
    split = page_fill.split_for_fill(images)
    assert split.bytes_moved > 0
    restored = CpuDriver().restore(image, images, log_path=tmp_path / "restore.log", progress=lambda m: None)
    try:
        assert restored.details["page_fill"]["bytes"] == split.bytes_moved, restored.details
        root = restored.root_pid
        assert os.readlink("/proc/%d/ns/pid" % root) != os.readlink("/proc/self/ns/pid") and inner_pid(root) == image.root_pid
        assert digest(port) == before
    finally:
        kill_tree(restored.root_pid)


def test_the_cpu_driver_splits_unless_the_fill_is_off_even_with_memory_on_demand(criu, tmp_path, monkeypatch):
    images, image, _, _ = dump_pattern(tmp_path, PAGES)
    kept = tmp_path / "kept"
    shutil.copytree(images, kept)
    driver = CpuDriver()
    monkeypatch.setattr(criu_tree, "_uffd", lambda argv: True)
    for lazy in (True, False):
        with settings.using(settings.current().replace(page_fill_threads=0, lazy_pages=lazy)):
            assert driver.stage_images(image, images) is None
    assert page_fill.indexes(images) == [] and contents(images) == contents(kept)
    with settings.using(settings.current().replace(page_fill_threads=2, lazy_pages=True)):
        staged = driver.stage_images(image, images)
    assert staged is not None and staged["page_fill_split"]["bytes_moved"] > 0, staged


def test_the_floor_of_a_filled_restore_counts_the_memory_written_by_several_threads():
    from sparkrun_coldsnap.bench import rates
    from sparkrun_coldsnap.host.bandwidth import fresh_memory_write

    machine = {"memory_write": 1e9, "memory_write_parallel": 4e9, "disk_read": 1e9}
    path = {"phases_median": {"restore": 1.0}, "bytes_median": {"restore": int(2e9), "prepare.stage": int(1e9)}}
    alone, filled = rates(path, machine, 0.1), rates({**path, "page_fill": True}, machine, 0.1)
    assert alone["phases"]["restore"]["bound_by"] == "memory_write" and alone["floor_seconds"] == pytest.approx(2.1)
    assert filled["phases"]["restore"]["bound_by"] == "memory_write_parallel" and filled["floor_seconds"] == pytest.approx(0.6)
    assert filled["cold_floor_seconds"] == pytest.approx(1.0 + 0.5 + 0.1)
    assert fresh_memory_write(64 << 20, threads=3) > 0  # shares that do not divide the area evenly


@pytest.mark.parametrize("linked", [False, True], ids=["own-copy", "hard-linked-copy"])
def test_images_staged_on_a_tmpfs_give_their_pages_back_as_they_are_written(criu, tmp_path, linked):
    dumped, image, port, before = dump_pattern(tmp_path, 4096)  # 16 MiB in the parent and the child
    shm = Path("/dev/shm") / ("fill-test-%d" % os.getpid())
    shutil.rmtree(shm, ignore_errors=True)
    try:
        if linked:  # a second link to every file, as a copy kept pristine beside the staging would be
            (shm / "pristine").mkdir(parents=True)
            shutil.copytree(dumped, shm / "pristine" / "images")
            shutil.copytree(shm / "pristine" / "images", shm / "images", copy_function=os.link)
        else:
            shutil.copytree(dumped, shm / "images")
        images = shm / "images"
        moved = page_fill.split_for_fill(images).bytes_moved
        data = sorted(images.glob("fill-*.pages"))
        assert moved >= 2 * 4096 * img.PAGE - (2 << 20) and data
        pid = restore(image, images, tmp_path)
        try:
            assert digest(port) == before
        finally:
            kill_tree(pid)
        held = sum(p.stat().st_blocks * 512 for p in data)
        if linked:
            # The other link still needs every byte: nothing is given back, the images stay usable.
            assert not page_fill.spent(images) and held >= moved
            return
        # Only what CRIU restored itself is still held (the data file is the whole pages image).
        assert page_fill.spent(images) and held <= sum(p.stat().st_size for p in data) - moved, (held, moved)
        # What is left would come back as zeros: a second restore of these images is refused
        # before CRIU starts anything.
        with pytest.raises(RestoreError, match="already used by a memory fill.*stage them again"):
            restore(image, images, tmp_path)
        assert alive(image.pids) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)
