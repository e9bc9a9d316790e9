"""Faults of the store, for real: a full disk while a capsule is written (a small tmpfs), a
read-only store, and several writers (and gc) on one store at the same time."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_capsule

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import gc
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.errors import StoreError

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s,mode=0750" % size, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def visible(store: CapsuleStore) -> list[str | None]:
    return [e.ref for e in store.entries()]


def test_a_full_disk_while_writing_a_capsule_leaves_nothing_and_a_retry_succeeds(tmp_path):
    with tmpfs(tmp_path / "small", "4m") as mnt:
        store = CapsuleStore(mnt / "store")
        make_capsule(store, tmp_path, "small", pages_mb=1)  # fits
        with pytest.raises(StoreError) as caught:
            make_capsule(store, tmp_path, "big", pages_mb=3)  # does not
        assert "no space left on the device" in caught.value.message and "\n" not in caught.value.message
        assert visible(store) == ["small:latest"]
        # What the interrupted write staged goes with its staging directory or the next sweep.
        for d in store.staging.glob("factory-*"):
            import shutil

            shutil.rmtree(d)  # the capture's own staging context does this; the helper has none
        assert gc.collect(store, apply=False).items == []
        capsule_mod.verify(store, capsule_mod.open_capsule(store, "small"))
        capsule_mod.verify(store, make_capsule(store, tmp_path, "retry", pages_mb=1))  # room again: a retry works


def test_a_read_only_store_refuses_writes_in_one_line_and_still_reads(tmp_path):
    with tmpfs(tmp_path / "ro", "16m") as mnt:
        store = CapsuleStore(mnt / "store")
        cap = make_capsule(store, tmp_path, "kept", pages_mb=1)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(StoreError) as caught:
            make_capsule(store, tmp_path, "new", pages_mb=1)
        assert "read-only" in caught.value.message.lower() or "cannot write" in caught.value.message
        assert visible(store) == ["kept:latest"]
        capsule_mod.verify(store, capsule_mod.open_capsule(store, "kept"))  # reading still works
        assert cap.digest == capsule_mod.open_capsule(store, "kept").digest


WRITER = """
import sys
sys.path.insert(0, %r)
from pathlib import Path
from helpers import make_capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
s = CapsuleStore(Path(%r))
for i in range(3):
    make_capsule(s, Path(%r), "w%%s-%%d" %% (sys.argv[1], i), pages_mb=1)
"""
COLLECTOR = """
import sys, time
sys.path.insert(0, %r)
from pathlib import Path
from sparkrun_coldsnap.capsule import gc
from sparkrun_coldsnap.capsule.store import CapsuleStore
s = CapsuleStore(Path(%r))
end = time.monotonic() + 8
while time.monotonic() < end:
    gc.collect(s, apply=True)
    time.sleep(0.01)
"""


def test_writers_and_gc_on_one_store_at_once_lose_nothing(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    tests = str(ROOT / "tests")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER % (tests, str(store.root), str(tmp_path / ("w%d" % n))), str(n)], cwd=str(ROOT), stderr=subprocess.PIPE, text=True) for n in range(3)]
    procs.append(subprocess.Popen([sys.executable, "-c", COLLECTOR % (tests, str(store.root))], cwd=str(ROOT), stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    refs = sorted(r for r in visible(store) if r)
    assert refs == sorted("w%d-%d:latest" % (n, i) for n in range(3) for i in range(3))
    for ref in refs:
        capsule_mod.verify(store, capsule_mod.open_capsule(store, ref))
    assert gc.collect(store, apply=False).items == []
