"""The native payload copied into a huge-page tmpfs during preparation (weights/weights_memory.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkrun_coldsnap.weights import weights_memory


def mounts() -> dict[str, str]:
    """Mount point -> file system type and options."""
    out = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        _, target, fstype, options, *_ = line.split()
        out[target] = "%s %s" % (fstype, options)
    return out


@pytest.fixture
def payload(tmp_path):
    d = tmp_path / "payload"
    d.mkdir()
    (d / "rank-0.bin").write_bytes(os.urandom((3 << 20) + 12345))  # not a whole number of chunks or blocks
    (d / "rank-0.json").write_text('{"format": 1}')
    return d


def test_the_copy_is_byte_for_byte_in_a_tmpfs_of_its_own_and_release_unmounts_it(payload, use_settings, tmp_path):
    use_settings(home=tmp_path / "home")
    staged = weights_memory.copy_into_memory(sorted(payload.iterdir()))
    try:
        assert staged.directory.parent == weights_memory.root()
        fs = mounts()[str(staged.directory)]
        assert fs.startswith("tmpfs ") and ("huge=always" in fs) == staged.huge_pages, fs
        for f in payload.iterdir():
            assert (staged.directory / f.name).read_bytes() == f.read_bytes()
        assert staged.bytes == sum(f.stat().st_size for f in payload.iterdir())
    finally:
        staged.release()
    assert str(staged.directory) not in mounts() and not staged.directory.exists()
    staged.release()  # twice is harmless


def test_a_copy_that_fails_leaves_nothing_mounted(payload, use_settings, tmp_path):
    use_settings(home=tmp_path / "home")
    unreadable = payload / "a-directory"
    unreadable.mkdir()
    with pytest.raises(OSError):
        weights_memory.copy_into_memory([payload / "rank-0.bin", unreadable])
    assert not any(t.startswith(str(weights_memory.root())) for t in mounts())
    assert list(weights_memory.root().iterdir()) == []


def test_a_copy_still_under_way_is_waited_for_once_and_let_go_with_its_choice(payload, use_settings, tmp_path, monkeypatch):
    import threading

    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

    use_settings(home=tmp_path / "home")
    go = threading.Event()
    calls = []

    def staged_later(cfg, choice, rb, progress, **_):
        go.wait(10)
        calls.append(choice)
        return WeightChoice("native", payload, in_memory=weights_memory.copy_into_memory(sorted(payload.iterdir())))

    monkeypatch.setattr(weights_memory, "stage_for_restore", staged_later)
    choice = WeightChoice("native", payload)
    job = weights_memory.start_staging(None, choice, ReceiptBuilder("restore"), weights_memory.QUIET)  # type: ignore[arg-type]
    assert job is not None and weights_memory.start_staging(None, WeightChoice("recovery"), ReceiptBuilder("restore"), weights_memory.QUIET) is None  # type: ignore[arg-type]
    pending = WeightChoice("native", payload, pending=job)
    go.set()
    settled = pending.settled()
    assert settled.in_memory is not None and (settled.in_memory.directory / "rank-0.bin").read_bytes() == (payload / "rank-0.bin").read_bytes()
    assert calls == [choice] and pending.settled() is settled  # waited for once
    pending.release_memory()
    assert str(settled.in_memory.directory) not in mounts()
