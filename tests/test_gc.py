"""Garbage collection: nothing a capsule needs is freed, everything a delete or an interrupted
write left is found, and the dry run changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers import make_capsule

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import gc
from sparkrun_coldsnap.capsule.store import CapsuleStore

ROOT = Path(__file__).resolve().parent.parent


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


def test_delete_leaves_no_blob_of_the_deleted_capsule(sparkrun, tmp_path):
    store = CapsuleStore(tmp_path / "store")
    keep = make_capsule(store, tmp_path, "keep", pages_mb=1)
    make_capsule(store, tmp_path, "gone", pages_mb=1)
    sparkrun.coldsnap("delete", "gone", "--store", str(store.root))
    assert gc.collect(store, apply=False).items == []
    capsule_mod.verify(store, capsule_mod.open_capsule(store, "keep"))  # everything of the other is there
    assert keep.digest == capsule_mod.open_capsule(store, "keep").digest


def test_gc_shows_then_frees_what_an_interrupted_write_left(sparkrun, tmp_path):
    store = CapsuleStore(tmp_path / "store")
    make_capsule(store, tmp_path, "keep", pages_mb=1)
    before = files_under(store.root / "blobs")
    # What a capture killed between moving its layers and tagging leaves: a blob nothing references,
    # and the staging directory of a process that is gone.
    orphan = store.blobs / ("ab" * 32)
    orphan.write_bytes(os.urandom(1000))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store.staging / ("capture-%d-xyz" % dead.pid)
    (stale / "units").mkdir(parents=True)
    (stale / "units" / "pages-1.img").write_bytes(b"\1" * 4096)
    live = store.new_staging_dir("capture-")  # this process's: an operation under way

    dry = sparkrun.coldsnap("gc", "--store", str(store.root), "--json")
    doc = json.loads(dry.stdout)
    assert [r["path"] for r in doc["blobs"]] == [str(orphan)]
    assert [r["path"] for r in doc["staging"]] == [str(stale)]
    assert not doc["applied"] and orphan.exists() and stale.exists()  # the dry run changes nothing
    text = sparkrun.coldsnap("gc", "--store", str(store.root)).stdout
    assert "would free 1 blobs, 1 staging directories" in text and "--yes" in text

    sparkrun.coldsnap("gc", "--store", str(store.root), "--yes")
    assert not orphan.exists() and not stale.exists() and live.exists()
    assert files_under(store.root / "blobs") == before
    capsule_mod.verify(store, capsule_mod.open_capsule(store, "keep"))


def test_a_write_killed_before_its_tag_leaves_nothing_after_the_next_write(tmp_path):
    """kill -9 of the writing process between moving blobs and tagging, for real."""
    store = CapsuleStore(tmp_path / "store")
    make_capsule(store, tmp_path, "first", pages_mb=1)
    before = files_under(store.root / "blobs")
    script = (
        "import os, sys, signal\n"
        "sys.path.insert(0, %r)\n"
        "from helpers import make_capsule\n"
        "from sparkrun_coldsnap.capsule.store import CapsuleStore\n"
        "s = CapsuleStore(%r)\n"
        "orig = CapsuleStore._write_index\n"
        "def die(self, manifests):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "CapsuleStore._write_index = die\n"
        "from pathlib import Path\n"
        "make_capsule(s, Path(%r), 'killed', pages_mb=1)\n"
    ) % (str(ROOT / "tests"), str(store.root), str(tmp_path / "w"))
    cp = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert cp.returncode == -9, cp.stderr
    assert [e.ref for e in store.entries()] == ["first:latest"]  # nothing partial is visible
    assert files_under(store.root / "blobs") - before  # it did move blobs before it died
    make_capsule(store, tmp_path, "second", pages_mb=1)  # the next write sweeps them
    assert gc.collect(store, apply=False).blobs == []
    assert {e.ref for e in store.entries()} == {"first:latest", "second:latest"}


def test_staging_a_live_process_uses_is_kept(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    dir_ = store.staging / "restore-999999999-abc"  # its creator is gone ...
    dir_.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(dir_)])  # ... but a live process still names it (a lazy-pages daemon)
    try:
        time.sleep(0.1)
        assert gc.collect(store, apply=True).staging == []
        assert dir_.exists()
    finally:
        holder.kill()
        holder.wait()
    assert [p for p, _ in gc.collect(store, apply=True).staging] == [dir_]
