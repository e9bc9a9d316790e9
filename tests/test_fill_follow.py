"""Hydration that follows a copy into memory still under way (a node with nothing prepared):
the plugin's marks (weights/fill_marks.py) against the engine side's reader of them, over a
real tmpfs copy, raw and packed, whole, given up and stalled."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from test_packed_payload import bf16_weights, sha256

from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.engines.vllm import VllmAdapter
from sparkrun_coldsnap.errors import EngineError, IntegrityError
from sparkrun_coldsnap.weights import fill_marks, packed_payload, weights_memory
from sparkrun_coldsnap.weights.engine_side.coldsnap_native_weights import FILLING, FillWaiter, copy_while_registering, layout
from sparkrun_coldsnap.weights.fill_marks import FillMark

MIB = 1 << 20


def test_both_sides_name_the_marks_alike():
    assert fill_marks.FILLING == FILLING


def test_a_mark_moves_to_the_end_of_what_is_in_place_without_a_gap(tmp_path):
    mark = FillMark(tmp_path, "rank-0.bin")
    assert mark.path == tmp_path / ".filling" / "rank-0.bin" and mark.path.stat().st_size == 0
    mark.done(100, 50)  # past a gap: not yet in place from the start
    assert mark.filled == 0 and mark.path.stat().st_size == 0
    mark.done(0, 60)
    assert mark.filled == 60 and mark.path.stat().st_size == 60
    mark.done(60, 40)  # closes the gap: the piece past it counts now
    assert mark.filled == 150 and mark.path.stat().st_size == 150
    mark.give_up()
    assert not mark.path.exists()
    mark.give_up()  # twice is harmless


def test_a_reader_waits_for_the_bytes_it_asks_and_no_longer(tmp_path):
    mark = FillMark(tmp_path, "f")
    wait = FillWaiter(str(tmp_path), "f", poll=0.001)
    threading.Timer(0.3, mark.done, args=(0, 1000)).start()
    wait(500)
    assert wait.filled == 1000 and 0.2 < wait.waited < 5
    before = wait.waited
    wait(1000)  # already in place: no look at the mark
    assert wait.waited == before


def test_a_stalled_copy_is_given_up_by_its_reader(tmp_path):
    FillMark(tmp_path, "f").done(0, 10)
    with pytest.raises(RuntimeError, match="stalled at byte 10"):
        FillWaiter(str(tmp_path), "f", stall=0.2, poll=0.01)(11)


@pytest.fixture
def payload(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_payload, "CHUNK", 1 << 20)
    monkeypatch.setattr(packed_payload, "SMALLEST", 1 << 20)
    d = tmp_path / "payload"
    d.mkdir()
    (d / "rank-0.bin").write_bytes(bf16_weights((6 << 19) + 333))
    (d / "rank-0.json").write_text('{"format": 1}')
    return d


def follow(directory: Path, names: dict[str, bytes], got: dict, *, stall: float = 10.0) -> None:
    """What the engine does while the copy goes on: the index whole first, then the payload
    piece by piece, each read only once the mark says it is in place."""
    try:
        for name in sorted(names, key=lambda n: len(names[n])):
            wait = FillWaiter(str(directory), name, stall=stall, poll=0.001)
            fd = os.open(directory / name, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size  # whole from the start: created at its size
                parts = []
                for off in range(0, size, 256 << 10):
                    n = min(256 << 10, size - off)
                    wait(off + n)
                    parts.append(os.pread(fd, n, off))
                got[name] = b"".join(parts)
                got["waited"] = got.get("waited", 0.0) + wait.waited
            finally:
                os.close(fd)
    except Exception as err:  # noqa: BLE001 - handed to the test
        got["error"] = err


@pytest.mark.parametrize("packed", [False, True], ids=["raw", "packed"])
def test_a_reader_follows_a_copy_under_way_byte_for_byte(payload, use_settings, tmp_path, packed):
    use_settings(home=tmp_path / "home")
    files = [payload / "rank-0.bin", payload / "rank-0.json"]
    source = {f.name: f.read_bytes() for f in files}
    indexes = {}
    if packed:
        raw = payload / "rank-0.bin"
        indexes[raw] = packed_payload.pack(raw, sha256(raw))
    got: dict = {}
    reader: list[threading.Thread] = []

    def on_ready(staged):
        # Every file is there at its full size before a byte is filled; the reader starts now.
        assert {f.name: (staged.directory / f.name).stat().st_size for f in files} == {n: len(b) for n, b in source.items()}
        reader.append(threading.Thread(target=follow, args=(staged.directory, source, got)))
        reader[0].start()
        time.sleep(0.3)  # the reader is waiting on the first mark meanwhile

    staged = weights_memory.copy_into_memory(files, packed=indexes, on_ready=on_ready)
    try:
        reader[0].join(30)
        assert "error" not in got, got.get("error")
        assert all(got[n] == b for n, b in source.items()) and got["waited"] > 0.2
        assert staged.read == (indexes[payload / "rank-0.bin"].packed_bytes + len(source["rank-0.json"]) if packed else sum(map(len, source.values())))
        assert all((staged.directory / FILLING / n).stat().st_size == len(b) for n, b in source.items())
    finally:
        staged.release()


def test_a_copy_given_up_stops_its_reader_at_once_and_leaves_nothing_mounted(payload, use_settings, tmp_path):
    use_settings(home=tmp_path / "home")
    raw = payload / "rank-0.bin"
    index = packed_payload.pack(raw, sha256(raw))
    assert index is not None and len(index.pieces) > 2
    offset, _, _ = index.pieces[2]
    with open(packed_payload.packed_path(raw), "r+b") as f:  # the third piece damaged
        f.seek(offset + 100)
        f.write(b"\xff" * 16)
    source = {f.name: f.read_bytes() for f in payload.iterdir() if f.is_file()}
    got: dict = {}
    reader: list[threading.Thread] = []

    def on_ready(staged):
        reader.append(threading.Thread(target=follow, args=(staged.directory, source, got), kwargs={"stall": 60}))
        reader[0].start()

    t = time.monotonic()
    with pytest.raises(IntegrityError, match="piece 2"):
        weights_memory.copy_into_memory([payload / "rank-0.json", raw], packed={raw: index}, on_ready=on_ready)
    reader[0].join(30)
    assert isinstance(got.get("error"), (RuntimeError, OSError)) and time.monotonic() - t < 20, got
    assert list(weights_memory.root().iterdir()) == []


def test_each_copy_is_queued_only_once_its_bytes_are_in_place_while_registration_goes_on():
    table = layout(("t%d" % i, n) for i, n in enumerate([3 * MIB, 5 * MIB, 1 * MIB, 7 * MIB]))
    total = sum(t["nbytes"] for t in table)
    in_place = [0]
    registered: list[int] = []
    copied: list[tuple[int, int, int]] = []

    def ready(end: int) -> None:
        assert registered, "registration waits for no byte"
        in_place[0] = max(in_place[0], end)

    def copy(i: int, a: int, b: int) -> None:
        assert b <= in_place[0], "bytes up to %d copied before they were in place (%d)" % (b, in_place[0])
        copied.append((i, a, b))

    copy_while_registering(
        table, total, register=lambda off, n: registered.append(off), unregister=lambda off, n: None, copy=copy, finish=lambda: None,
        piece=4 * MIB, threads=2, ready=ready,
    )  # fmt: skip
    assert sum(b - a for _, a, b in copied) == total and in_place[0] == total


class OldReader(VllmAdapter):
    """An engine whose reader (as old as its capsule) cannot follow a copy under way: five
    arguments are one too many, as vLLM's collective_rpc says of a method it cannot call so."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _rpc(self, endpoint, method, *args):
        self.calls.append((method, *args))
        if method == "coldsnap_load_native_mapped" and len(args) == 5:
            raise EngineError("vLLM coldsnap_load_native_mapped failed: HTTP 500: takes from 2 to 5 positional arguments but 6 were given")
        return ({"rank": 0, "mapped": method.endswith("mapped")},)


@pytest.mark.parametrize("whole", [True, False], ids=["copy-whole", "copy-given-up"])
def test_an_old_reader_waits_for_the_whole_copy_or_reads_the_disk(whole):
    adapter = OldReader()
    waited: list[bool] = []

    def filling() -> bool:
        waited.append(True)
        return whole

    out = adapter._load_native(Endpoint("http://127.0.0.1:1", "m"), "/payload", False, "/memory", filling)
    methods = [c[0] for c in adapter.calls]
    assert waited == [True] and methods[0] == "coldsnap_load_native_mapped" and adapter.calls[0][-1] is True
    if whole:
        assert methods == ["coldsnap_load_native_mapped"] * 2 and out[0]["mapped"] is True
    else:
        assert methods == ["coldsnap_load_native_mapped", "coldsnap_load_native"] and "did not finish" in out[0]["mapped_failed"]


def test_a_staging_job_hands_the_copy_over_before_it_is_filled_or_none_when_it_ended_first(payload, use_settings, tmp_path, monkeypatch):
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

    use_settings(home=tmp_path / "home")
    go = threading.Event()
    copies = []

    def stage(cfg, choice, rb, progress, *, on_ready=None, from_packed=None, shared=False):
        def ready(staged):
            on_ready(staged)
            go.wait(10)  # held until the test has seen the early copy

        copies.append(weights_memory.copy_into_memory(sorted(payload.iterdir()), on_ready=ready))
        return WeightChoice("native", payload, in_memory=copies[0])

    monkeypatch.setattr(weights_memory, "stage_for_restore", stage)
    job = weights_memory.StagingJob(None, WeightChoice("native", payload), ReceiptBuilder("restore"))  # type: ignore[arg-type]
    early = job.early()
    assert early is not None and not job._future.done() and (early.directory / FILLING / "rank-0.bin").stat().st_size == 0
    go.set()
    pending = WeightChoice("native", payload, pending=job)
    assert pending.copied_whole() and pending.settled().in_memory is early
    pending.release_memory()

    monkeypatch.setattr(weights_memory, "stage_for_restore", lambda cfg, choice, rb, progress, **_: choice)  # skipped: too big, say
    skipped = weights_memory.StagingJob(None, WeightChoice("native", payload), ReceiptBuilder("restore"))  # type: ignore[arg-type]
    assert skipped.early() is None and not WeightChoice("native", payload, pending=skipped).copied_whole()


def test_the_cold_floor_counts_the_restore_beside_the_weights_read_not_after_it():
    from sparkrun_coldsnap.bench import rates

    machine = {"memory_write": 1e9, "disk_read": 1e9}
    moved = {"restore": int(2e9), "prepare.stage": int(0.5e9), "prepare.layers_cache": int(0.5e9), "prepare.files_cache": int(0.5e9), "prepare.weights_memory": int(9e9)}
    out = rates({"phases_median": {"restore": 2.0}, "bytes_median": moved}, machine, 0.1)
    assert out["cold_floor_seconds"] == pytest.approx(10.0 + 0.1)  # the disk, not 1 + 9 + 2
    small = rates({"phases_median": {"restore": 2.0}, "bytes_median": {**moved, "prepare.weights_memory": int(1e9)}}, machine, 0.1)
    assert small["cold_floor_seconds"] == pytest.approx(1.0 + 2.0 + 0.1)  # the restore is the longer way


def test_a_staging_job_given_something_to_wait_for_starts_copying_only_after_it(monkeypatch):
    from concurrent.futures import Future

    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

    first: Future[None] = Future()
    called: list[bool] = []

    def stage(cfg, choice, rb, progress, **_):
        called.append(first.done())
        return choice

    monkeypatch.setattr(weights_memory, "stage_for_restore", stage)
    job = weights_memory.StagingJob(None, WeightChoice("native", Path("/payload")), ReceiptBuilder("restore"), after=first)  # type: ignore[arg-type]
    time.sleep(0.3)
    assert called == [] and not job._future.done()
    first.set_exception(OSError("the files' read failed"))  # its own caller reports that; the copy still goes
    assert job.result().path == "native" and called == [True]


@pytest.mark.parametrize("files_skipped", [False, True])
def test_preparation_reads_what_the_restore_needs_first_and_the_payload_behind_the_files(monkeypatch, tmp_path, files_skipped):
    """The order on a node with nothing prepared: the capsule's layers at once, the tree's files
    beside the unpacking, the payload once the files' reads are queued (or the files' read ended
    without queueing any), the restore not waiting for it."""
    from types import SimpleNamespace

    from sparkrun_coldsnap.controller import restore, restore_here
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.weights.weight_paths import WeightChoice

    events: list[str] = []
    files_go, payload_began = threading.Event(), threading.Event()
    staged = SimpleNamespace(details={}, discard=lambda: events.append("discarded"))
    programs = (tmp_path / "criu",)
    r = SimpleNamespace(driver=SimpleNamespace(program_files=lambda units=(): programs), adapter=SimpleNamespace(maps_native=True), launcher=SimpleNamespace(executor="local", stage_phase="prepare.warm_up", stage=lambda *a, **k: staged))
    cap = SimpleNamespace(layers=[SimpleNamespace(digest="sha256:" + "a" * 64)], config=SimpleNamespace(units=[SimpleNamespace(name="unit")]))
    store = SimpleNamespace(blob_path=lambda digest: tmp_path / digest)
    monkeypatch.setattr(restore, "open_trusted", lambda *a, **k: cap)
    monkeypatch.setattr(restore, "refuse_driver", lambda *a, **k: None)
    monkeypatch.setattr(restore_here, "require_one_unit", lambda *a, **k: None)
    monkeypatch.setattr(restore_here, "resolve", lambda *a, **k: r)
    monkeypatch.setattr(restore_here, "admit_here", lambda *a, **k: (WeightChoice("native", tmp_path), ()))
    monkeypatch.setattr(restore_here, "new_restore_staging", lambda store, size: tmp_path / "staging")
    monkeypatch.setattr(restore_here, "unpacked_size", lambda cap: 0)
    monkeypatch.setattr(restore_here.page_cache, "cache_capsule_layers", lambda blobs, rb, progress: events.append("layers"))

    def files(units, rb, progress, *, programs, queued, **_):
        assert programs == (tmp_path / "criu",)  # the restore's own tools are read with the files
        events.append("files begin")
        if files_skipped:
            return
        files_go.wait(10)  # the layers are being unpacked
        queued()
        assert payload_began.wait(10)  # the payload's reads go in behind the files'
        events.append("files end")

    def unpack(store, cap, staging, rb, progress):
        events.append("unpack")
        files_go.set()

    def stage(cfg, choice, rb, progress, **_):
        events.append("payload")
        payload_began.set()
        return choice

    monkeypatch.setattr(restore_here.page_cache, "cache_tree_files", files)
    monkeypatch.setattr(restore_here, "unpack_capsule", unpack)
    monkeypatch.setattr(weights_memory, "stage_for_restore", stage)
    req = SimpleNamespace(digest=lambda: "0" * 64, capsule=SimpleNamespace(ref="c:latest"), workload=SimpleNamespace(secret_values=lambda: (), model=SimpleNamespace(path=None)))
    cold = settings_mod.current().replace(cache_in_background=True, weights_memory=True)
    prepared = restore.prepare(req, restore_here.HereRestore(), store=store, settings=cold)  # type: ignore[arg-type]
    assert prepared.weights is not None and prepared.weights.pending is not None  # the restore goes ahead
    prepared.weights.settled()
    if files_skipped:
        assert events[:2] == ["layers", "files begin"] and sorted(events[2:]) == ["payload", "unpack"], events
    else:
        assert events == ["layers", "files begin", "unpack", "payload", "files end"], events
