"""Weights read into the page cache during preparation: only what hydration will read, only when it fits."""

from __future__ import annotations

import os

import pytest
from helpers import make_capsule, make_model

from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.progress import QUIET
from sparkrun_coldsnap.weights import native_payload, page_cache, weight_paths


def available(kib: int | None) -> int:
    """MemAvailable in bytes, as the plan is given it (unknown counts as none)."""
    return (kib or 0) * 1024


def test_a_plan_fits_in_half_of_the_available_memory(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 << 20))
    assert page_cache.plan([f], available(8 << 10)).fits  # 3 MiB of 8 MiB
    tight = page_cache.plan([f], available(4 << 10))
    assert not tight.fits and tight.why_not() == "0.0 GB of weights, 0.0 GB of memory available (at most half of it is used)"
    assert not page_cache.plan([f], available(None)).fits  # unknown: nothing is read ahead


@pytest.mark.parametrize("small_ranges", [False, True])
def test_read_ahead_reads_every_byte_once(tmp_path, monkeypatch, small_ranges):
    if small_ranges:  # several ranges per file, several reads per range, a short last one
        monkeypatch.setattr(page_cache, "RANGE", 1 << 20)
        monkeypatch.setattr(page_cache, "READ", 64 << 10)
    files = []
    for i, size in enumerate((0, 1, (16 << 20) + 5, 4096)):
        files.append(tmp_path / ("f%d" % i))
        files[-1].write_bytes(os.urandom(size))
    ticks = []
    assert page_cache.read_ahead(files, ticks.append) == sum(f.stat().st_size for f in files) == sum(ticks)


def test_switch():
    assert Settings.from_environ({}).weights_cache
    assert not Settings.from_environ({"COLDSNAP_WEIGHTS_CACHE": "off"}).weights_cache


def test_preparation_caches_what_the_chosen_path_reads(tmp_path, use_settings):
    use_settings(home=tmp_path / "home", weights_cache=True)
    written = tmp_path / "written"
    written.mkdir()
    (written / "rank-0.bin").write_bytes(os.urandom(1 << 20))
    (written / "rank-0.json").write_text("{}")
    record = native_payload.seal(written)
    model = make_model(tmp_path / "model")
    cap = make_capsule(CapsuleStore(tmp_path / "store"), tmp_path, model_dir=model, native=record)

    native = weight_paths.WeightChoice("native", native_payload.directory(record))
    rb = ReceiptBuilder("restore")
    cached = page_cache.cache_for_restore(cap.config, native, str(model), rb, QUIET)
    assert cached.cached and rb.details["weights_cache"]["bytes"] == sum(f.size for f in record.files)
    assert [p.name for p in rb.phases] == ["prepare.weights_cache"]

    rb = ReceiptBuilder("restore")
    recovery = page_cache.cache_for_restore(cap.config, weight_paths.WeightChoice("recovery"), str(model), rb, QUIET)
    assert recovery.cached and rb.details["weights_cache"]["bytes"] == sum(f.size for f in cap.config.weights.files)

    rb = ReceiptBuilder("restore")
    assert not page_cache.cache_for_restore(cap.config, native, str(model), rb, QUIET, enabled=False).cached
    assert rb.details["weights_cache"] == {"skipped": "COLDSNAP_WEIGHTS_CACHE=off"}

    (native_payload.directory(record) / "rank-0.bin").unlink()
    rb = ReceiptBuilder("restore")
    assert not page_cache.cache_for_restore(cap.config, native, str(model), rb, QUIET).cached
    assert rb.details["weights_cache"]["skipped"].startswith("reading ")


def test_read_ahead_of_ranges_queues_them_all_before_any_read_waits(tmp_path, monkeypatch):
    """The files a tree maps: every range handed to the kernel at once, then *queued* (what reads
    after it lines up behind them), then each range read; nothing outside the ranges."""
    f = tmp_path / "lib.so"
    f.write_bytes(os.urandom(9 << 20))
    spans = {f: [(0, 4096), (1 << 20, 5 << 20)]}
    order: list[str] = []
    advised: list[tuple[int, int]] = []
    real_advise, real_pread = os.posix_fadvise, os.preadv

    def advise(fd, offset, length, how):
        assert how == os.POSIX_FADV_WILLNEED
        advised.append((offset, length))
        order.append("advise")
        real_advise(fd, offset, length, how)

    def pread(fd, bufs, offset):
        order.append("read")
        return real_pread(fd, bufs, offset)

    monkeypatch.setattr(page_cache.os, "posix_fadvise", advise)
    monkeypatch.setattr(page_cache.os, "preadv", pread)
    assert page_cache.read_ahead([f], spans=spans, queued=lambda: order.append("queued")) == 4096 + (5 << 20)
    # a range longer than one request is asked for in requests the kernel takes whole
    assert advised == [(0, 4096), (1 << 20, 4 << 20), (5 << 20, 1 << 20)]
    assert order.index("queued") == len(advised) and set(order[len(advised) + 1 :]) == {"read"}


def test_the_restore_tools_are_read_whole_with_the_tree_files(tmp_path):
    from types import SimpleNamespace

    lib, tool = tmp_path / "lib.so", tmp_path / "criu"
    lib.write_bytes(os.urandom(3 << 20))
    tool.write_bytes(os.urandom(1 << 20))
    unit = SimpleNamespace(files=[SimpleNamespace(path=str(lib), resident=((0, 8192),))])
    rb, queued = ReceiptBuilder("restore"), []
    page_cache.cache_tree_files([unit], rb, QUIET, programs=(tool, tmp_path / "gone"), queued=lambda: queued.append(True))  # type: ignore[list-item]
    assert rb.details["files_cache"]["bytes"] == 8192 + (1 << 20) and rb.details["files_cache"]["files"] == 2
    assert queued == [True]
