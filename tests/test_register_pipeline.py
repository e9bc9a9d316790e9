"""The weights' hydration from memory registers the mapping with CUDA in pieces while the
pieces already registered are copied. No GPU here: the CUDA calls are FAKE callables that
keep the driver's rules the pipeline relies on (a range is registered once, a copy reads
only registered memory and only within one registration: on the H200 a copy across two
was refused with "invalid argument"; whatever was registered is unregistered), checked as
they are called. The real calls run in the engine's worker on the GPU machine."""

from __future__ import annotations

import threading
import time

import pytest

from sparkrun_coldsnap.weights.engine_side.coldsnap_native_weights import (
    HUGE_PAGE,
    copy_while_registering,
    layout,
    register_pieces,
    segments_by_piece,
)

MIB = 1 << 20


class FakeCudaHost:
    """Registered host ranges as the driver keeps them: overlapping registrations and
    unregistering what was never registered fail, as cudaHostRegister/Unregister do."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.ranges: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.copied: list[int] = []
        self.fail_at = fail_at
        self.delay = delay
        self.lock = threading.Lock()

    def register(self, off: int, n: int) -> None:
        time.sleep(self.delay)
        with self.lock:
            if self.fail_at is not None and off <= self.fail_at < off + n:
                raise RuntimeError("cudaHostRegister of %d bytes at offset %d failed (error 2)" % (n, off))
            if any(off < o + m and o < off + n for o, m in self.ranges.items()):
                raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
            self.ranges[off] = n

    def unregister(self, off: int, n: int) -> None:
        with self.lock:
            if self.ranges.pop(off, None) != n:
                raise RuntimeError("cudaErrorHostMemoryNotRegistered")
            self.unregistered.append(off)

    def covered(self, start: int, end: int) -> bool:
        """Whether [start, end) lies inside one registration: the driver refuses a copy from
        registered memory that runs into the next registration."""
        with self.lock:
            return any(off <= start and end <= off + n for off, n in self.ranges.items())


def tensors(sizes: list[int]) -> list[dict]:
    return layout(("t%d" % i, n) for i, n in enumerate(sizes))


def run(table: list[dict], total: int, cuda: FakeCudaHost, *, piece: int, threads: int) -> dict:
    def copy(i: int, a: int, b: int) -> None:
        t = table[i]
        assert t["offset"] <= a < b <= t["offset"] + t["nbytes"], "bytes %d-%d are not tensor %d's" % (a, b, i)
        assert cuda.covered(a, b), "tensor %d copied from memory not inside one registration" % i
        cuda.copied.append((i, a, b))

    return copy_while_registering(table, total, register=cuda.register, unregister=cuda.unregister, copy=copy, finish=lambda: None, piece=piece, threads=threads)


def test_pieces_are_whole_huge_pages_and_cover_the_mapping_once():
    total = 9 * HUGE_PAGE + 12345
    pieces = register_pieces(total, 3 * HUGE_PAGE + 1)  # rounded down to whole huge pages
    assert [n for _, n in pieces[:-1]] == [3 * HUGE_PAGE] * 3 and pieces[-1] == (9 * HUGE_PAGE, 12345)
    assert register_pieces(total, 1)[0] == (0, HUGE_PAGE)  # never less than one huge page
    assert register_pieces(total, total) == [(0, total)]  # one piece: the whole mapping at once


def test_a_tensor_across_pieces_is_copied_in_parts_each_inside_one_piece():
    table = tensors([3 * MIB, 2 * MIB, 6 * MIB, 1])  # the second crosses 4 MiB, the third 8 MiB
    pieces = register_pieces(11 * MIB + 1, 2 * HUGE_PAGE)  # [0, 4), [4, 8), [8, 11 MiB + 1)
    assert segments_by_piece(table, pieces) == [
        [(0, 0, 3 * MIB), (1, 3 * MIB, 4 * MIB)],
        [(1, 4 * MIB, 5 * MIB), (2, 5 * MIB, 8 * MIB)],
        [(2, 8 * MIB, 11 * MIB), (3, 11 * MIB, 11 * MIB + 1)],
    ]


@pytest.mark.parametrize("threads", [1, 4])
def test_every_tensor_is_copied_from_registered_memory_and_every_piece_unregistered(threads):
    sizes = [5 * MIB, 1 * MIB, 17 * MIB, 3, 2 * MIB, 9 * MIB]
    table = tensors(sizes)
    total = sum(sizes)
    cuda = FakeCudaHost(delay=0.01)
    report = run(table, total, cuda, piece=4 * MIB, threads=threads)
    assert sum(b - a for _, a, b in cuda.copied) == total and {i for i, _, _ in cuda.copied} == set(range(len(sizes)))
    assert cuda.ranges == {} and len(cuda.unregistered) == report["pieces"] == len(register_pieces(total, 4 * MIB))
    assert report["register_threads"] == threads


def test_one_piece_is_the_whole_mapping_registered_at_once():
    table = tensors([3 * MIB, 5 * MIB])
    cuda = FakeCudaHost()
    report = run(table, 8 * MIB, cuda, piece=1 << 30, threads=4)
    assert report["pieces"] == 1 and cuda.unregistered == [0]


def test_a_failed_registration_is_raised_and_leaves_nothing_registered():
    sizes = [4 * MIB] * 6
    table = tensors(sizes)
    cuda = FakeCudaHost(fail_at=13 * MIB)  # the fourth 4 MiB piece
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4194304 bytes at offset 12582912 failed"):
        run(table, sum(sizes), cuda, piece=4 * MIB, threads=2)
    assert cuda.ranges == {}  # the pieces registered before and beside it were let go
    assert all(b <= 12 * MIB for _, _, b in cuda.copied)  # nothing of the piece that failed, or after it


def test_kept_pieces_stay_registered_for_the_caller_to_let_go():
    sizes = [5 * MIB, 3 * MIB, 9 * MIB]
    table = tensors(sizes)
    cuda = FakeCudaHost()
    kept: list[tuple[int, int]] = []

    def copy(i: int, a: int, b: int) -> None:
        cuda.copied.append(i)

    report = copy_while_registering(table, sum(sizes), register=cuda.register, unregister=cuda.unregister, copy=copy, finish=lambda: None, piece=4 * MIB, threads=2, kept=kept)
    assert sorted(kept) == sorted(cuda.ranges.items()) and len(kept) == report["pieces"] and not cuda.unregistered
    for off, n in kept:
        cuda.unregister(off, n)
    assert cuda.ranges == {}


def test_a_failed_run_keeps_nothing_even_when_asked_to():
    table = tensors([4 * MIB] * 4)
    cuda = FakeCudaHost(fail_at=9 * MIB)
    kept: list[tuple[int, int]] = []
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        copy_while_registering(table, 16 * MIB, register=cuda.register, unregister=cuda.unregister, copy=lambda i, a, b: None, finish=lambda: None, piece=4 * MIB, threads=2, kept=kept)
    assert kept == [] and cuda.ranges == {}


def test_a_failed_copy_still_unregisters_every_piece():
    table = tensors([4 * MIB] * 4)
    cuda = FakeCudaHost()

    def copy(i: int, a: int, b: int) -> None:
        if i == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        copy_while_registering(table, 16 * MIB, register=cuda.register, unregister=cuda.unregister, copy=copy, finish=lambda: None, piece=4 * MIB, threads=4)
    assert cuda.ranges == {}


def test_the_bench_reports_the_slowest_worker_s_registration_and_copy():
    from sparkrun_coldsnap.bench import hydrate_steps, table

    notes = {"hydrate": [{"rank": 0, "register_seconds": 0.2, "copy_seconds": 0.05}, {"rank": 1, "register_seconds": 0.3, "copy_seconds": 0.01}]}
    assert hydrate_steps(notes) == {"register": 0.3, "copy": 0.05}
    assert hydrate_steps({"hydrate": [{"mapped_failed": "no reader"}, {"rank": 0, "seconds": 1.0}]}) == {}  # read from disk: no such steps
    assert hydrate_steps({}) == {}
    one = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    doc = {
        "vanilla_ttft": {**one, "median": 30.0, "min": 30.0, "max": 30.0},
        "paths": {"n610 native": {"ttft": one, "prepare": one, "phases_median": {"hydrate": 0.4}, "speedup_median": 30.0, "hydrate_steps_median": hydrate_steps(notes)}},
    }
    assert "  inside hydrate: register 0.30s, copy 0.05s" in table(doc).splitlines()
