"""Weights read into the page cache during preparation: only what hydration will read, only when it fits."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from capsule_factory import make_capsule, make_model
from sparkrun_coldsnap import controller, native_payload, page_cache, weight_paths
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.receipts import ReceiptBuilder


def meminfo(tmp_path, available_kib: int | None):
    p = tmp_path / "meminfo"
    lines = ["MemTotal:       65536000 kB"] + (["MemAvailable:   %d kB" % available_kib] if available_kib is not None else [])
    p.write_text("\n".join(lines) + "\n")
    return p


def test_a_plan_fits_in_half_of_the_available_memory(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 << 20))
    assert page_cache.plan([f], meminfo(tmp_path, 8 << 10)).fits  # 3 MiB of 8 MiB
    tight = page_cache.plan([f], meminfo(tmp_path, 4 << 10))
    assert not tight.fits and tight.why_not() == "0.0 GB of weights, 0.0 GB of memory available (at most half of it is used)"
    assert not page_cache.plan([f], meminfo(tmp_path, None)).fits  # unknown: nothing is read ahead


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


def test_switch(monkeypatch):
    monkeypatch.delenv("COLDSNAP_WEIGHTS_CACHE", raising=False)
    assert not page_cache.switched_off()
    monkeypatch.setenv("COLDSNAP_WEIGHTS_CACHE", "off")
    assert page_cache.switched_off()


def test_preparation_caches_what_the_chosen_path_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("COLDSNAP_WEIGHTS_CACHE", raising=False)
    written = tmp_path / "written"
    written.mkdir()
    (written / "rank-0.bin").write_bytes(os.urandom(1 << 20))
    (written / "rank-0.json").write_text("{}")
    record = native_payload.seal(written)
    model = make_model(tmp_path / "model")
    cap = make_capsule(CapsuleStore(tmp_path / "store"), tmp_path, model_dir=model, native=record)
    req = SimpleNamespace(workload=SimpleNamespace(model=SimpleNamespace(path=str(model))))

    native = weight_paths.WeightChoice("native", native_payload.directory(record))
    rb = ReceiptBuilder("restore")
    cached = controller._cache_weights(cap, req, native, rb, controller.QUIET)
    assert cached.cached and rb.details["weights_cache"]["bytes"] == sum(f.size for f in record.files)
    assert rb.phase_seconds("prepare.weights_cache") >= 0 and any(p.name == "prepare.weights_cache" for p in rb._phases)

    rb = ReceiptBuilder("restore")
    recovery = controller._cache_weights(cap, req, weight_paths.WeightChoice("recovery"), rb, controller.QUIET)
    assert recovery.cached and rb.details["weights_cache"]["bytes"] == sum(f.size for f in cap.config.weights.files)

    monkeypatch.setenv("COLDSNAP_WEIGHTS_CACHE", "off")
    rb = ReceiptBuilder("restore")
    assert not controller._cache_weights(cap, req, native, rb, controller.QUIET).cached
    assert rb.details["weights_cache"] == {"skipped": "COLDSNAP_WEIGHTS_CACHE=off"}

    monkeypatch.delenv("COLDSNAP_WEIGHTS_CACHE")
    (native_payload.directory(record) / "rank-0.bin").unlink()
    rb = ReceiptBuilder("restore")
    assert not controller._cache_weights(cap, req, native, rb, controller.QUIET).cached
    assert rb.details["weights_cache"]["skipped"].startswith("reading ")
