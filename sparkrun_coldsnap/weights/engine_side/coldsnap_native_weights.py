"""The native weight payload, from inside vLLM's worker processes.

Loaded with ``--worker-extension-cls coldsnap_native_weights.NativeWeights`` and
called through vLLM's ``/collective_rpc``. At capture each worker writes the storage of
every parameter and buffer it holds *as loaded* (after vLLM's fusing and post-processing)
to one flat file; after restore it reads that file straight back into the same storages
(the allocator puts them back at the same addresses when the weights wake): no safetensors
parsing, no name mapping, no re-processing. The file is read in large aligned chunks
by several threads at once (``O_DIRECT`` where the file system allows it, so a cold
page cache is not a second copy) into pinned buffers, and each chunk is copied to the
device while the next ones are still being read.

Standard library and torch only: this runs in the engine's interpreter.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

FORMAT = 1
ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers on block boundaries
CHUNK = 64 << 20
# Copying from the page cache runs at a few GB/s a thread: enough readers to keep a PCIe Gen5
# link busy, on the cores the host has.
READERS = max(8, min(16, os.cpu_count() or 8))
HUGE_PAGE = 2 << 20
# The mapping in memory is registered with CUDA in pieces while earlier pieces are copied
# (the plugin passes its settings; these are for a caller that passes none).
REGISTER_PIECE = 1 << 30
REGISTER_THREADS = 4
# A copy into memory still under way (a node with nothing prepared): beside each file being
# filled, FILLING/<name> holds as many bytes as the file has in place from its start, and is
# gone when the copy was given up. The plugin writes it (weights/fill_marks.py).
FILLING = ".filling"
# No progress for this long and the copy is taken as given up.
FILL_STALL = 120.0
FILL_POLL = 0.002


def payload_names(rank: int) -> tuple[str, str]:
    return "rank-%d.bin" % rank, "rank-%d.json" % rank


def layout(entries: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    """Back-to-back offsets for (name, nbytes) in the given order."""
    out, offset = [], 0
    for name, nbytes in entries:
        out.append({"name": name, "offset": offset, "nbytes": nbytes})
        offset += nbytes
    return out


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(off, min(size, total - off)) for off in range(0, total, size)]


def copies_for(chunk_off: int, chunk_len: int, tensors: list[dict[str, Any]], offsets: list[int]) -> list[tuple[int, int, int, int]]:
    """Which bytes of a chunk go where: (tensor index, offset in chunk, offset in tensor, length).
    *offsets* are the tensors' ascending offsets (as ``layout`` lays them), so only the tensors
    the chunk overlaps are looked at."""
    out = []
    end = chunk_off + chunk_len
    for i in range(max(bisect.bisect_right(offsets, chunk_off) - 1, 0), len(tensors)):
        t = tensors[i]
        if t["offset"] >= end:
            break
        a, b = max(chunk_off, t["offset"]), min(end, t["offset"] + t["nbytes"])
        if a < b:
            out.append((i, a - chunk_off, a - t["offset"], b - a))
    return out


class FillWaiter:
    """``wait(upto)`` returns once the first *upto* bytes of DIRECTORY/name are in place, as
    its mark in FILLING says; RuntimeError when the copy was given up (the mark is gone) or
    stalls for *stall* seconds. ``waited``: the seconds spent waiting so far."""

    def __init__(self, directory: str, name: str, *, stall: float = FILL_STALL, poll: float = FILL_POLL) -> None:
        self.name = name
        self.mark = os.path.join(directory, FILLING, name)
        self.stall, self.poll = stall, poll
        self.filled = 0
        self.waited = 0.0

    def __call__(self, upto: int) -> None:
        if upto <= self.filled:
            return
        t0 = time.monotonic()
        last, since = -1, t0
        try:
            while True:
                try:
                    n = os.stat(self.mark).st_size
                except FileNotFoundError:
                    raise RuntimeError("the copy of %s into memory was given up at byte %d" % (self.name, self.filled)) from None
                if n >= upto:
                    self.filled = n
                    return
                if n != last:
                    last, since = n, time.monotonic()
                elif time.monotonic() - since > self.stall:
                    raise RuntimeError("the copy of %s into memory stalled at byte %d for %.0f s" % (self.name, n, self.stall))
                time.sleep(self.poll)
        finally:
            self.waited += time.monotonic() - t0


def register_pieces(total: int, piece: int) -> list[tuple[int, int]]:
    """The mapping cut into pieces of *piece* bytes (a multiple of 2 MiB: whole huge pages,
    so no page is registered twice), the last one shorter."""
    if piece >= total:
        return [(0, total)] if total else []
    return chunks(total, max(HUGE_PAGE, piece // HUGE_PAGE * HUGE_PAGE))


def segments_by_piece(tensors: list[dict[str, Any]], pieces: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
    """For each piece, the bytes to copy once it is registered: (tensor index, start, end) in
    payload offsets, a tensor that spans pieces cut at their boundaries. The GPU copies from
    registered host memory only within one registration (a copy across two is refused with
    "invalid argument"), so no copy may cross a boundary."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in pieces]
    starts = [off for off, _ in pieces]
    for i, t in enumerate(tensors):
        a, end = t["offset"], t["offset"] + t["nbytes"]
        k = max(bisect.bisect_right(starts, a) - 1, 0)
        while a < end:
            piece_end = pieces[k][0] + pieces[k][1] if k < len(pieces) else end
            b = min(end, piece_end)
            out[min(k, len(pieces) - 1)].append((i, a, b))
            a, k = b, k + 1
    return out


def copy_while_registering(
    tensors: list[dict[str, Any]], total: int, *, register, unregister, copy, finish, piece: int, threads: int,
    kept: list[tuple[int, int]] | None = None, ready=None,
) -> dict[str, Any]:  # fmt: skip
    """Register the mapping with CUDA piece by piece on *threads* threads while the copies of
    the pieces already registered run: pinning 14 GB takes about as long as the GPU takes to
    copy it, so done one after the other they add up and overlapped they nearly do not.
    *copy(i, start, end)* queues the copy of payload bytes [start, end) into tensor i (never
    across a piece's boundary), *finish()* waits for every queued copy; every piece that
    was registered is unregistered, also when a registration or a copy fails. Given a list as
    *kept*, a run that succeeds leaves its pieces registered and puts them there instead:
    unregistering 14 GB takes a good part of a second, which the caller can spend later, once
    the restored engine has answered. *ready(end)*, when given, returns once the payload's
    bytes up to *end* are in the mapping (a copy into memory still under way): each copy is
    queued only then, while the registration goes on meanwhile."""
    pieces = register_pieces(total, piece)
    groups = segments_by_piece(tensors, pieces)
    registered: list[tuple[int, int]] = []
    lock = threading.Lock()
    succeeded = False

    def pin(k: int) -> None:
        register(*pieces[k])
        with lock:
            registered.append(pieces[k])

    t0 = time.monotonic()
    waited = 0.0
    pool = ThreadPoolExecutor(max(1, threads))
    try:
        futures = [pool.submit(pin, k) for k in range(len(pieces))]
        for k, fut in enumerate(futures):
            t_wait = time.monotonic()
            fut.result()
            waited += time.monotonic() - t_wait
            for i, a, b in groups[k]:
                if ready is not None:
                    ready(b)
                copy(i, a, b)
        t_registered = time.monotonic()
        finish()
        t_end = time.monotonic()
        succeeded = True
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if succeeded and kept is not None:
            kept.extend(registered)
        else:
            for off, n in registered:
                unregister(off, n)
    return {
        "register_seconds": round(t_registered - t0, 4), "copy_seconds": round(t_end - t_registered, 4),
        "register_wait_seconds": round(waited, 4), "pieces": len(pieces), "register_threads": max(1, threads),
    }  # fmt: skip


def _held_storages(model) -> list[tuple[str, Any]]:
    """The storage behind every parameter and buffer (rotary caches, scales) of the loaded
    model, once each, as a flat byte tensor, named after the first tensor using it. Whole
    storages, so transposed or strided views and tied weights need no special case.
    These are what a level-2 sleep takes off the device and vLLM's own reload puts back.
    Plain tensor attributes are left out: the KV cache is one, and it is no weight."""
    import torch

    found = list(model.named_parameters()) + list(model.named_buffers())
    seen, out = set(), []
    for name, t in found:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append((name, torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)))
    return out


def _aligned_buffer(nbytes: int, *, pin: bool):
    """A byte tensor starting on a block boundary, as O_DIRECT needs (pinned memory is
    page-aligned already; the CPU allocator only promises 64 bytes)."""
    import torch

    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


def _open_for_reading(path: str, *, direct: bool = True) -> tuple[int, bool]:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0) if direct else 0
    if o_direct:
        try:
            return os.open(path, flags | o_direct), True
        except OSError:
            pass  # tmpfs and some overlays refuse O_DIRECT: buffered reads then
    return os.open(path, flags), False


def _read_into(fds: tuple[int, int], view: memoryview, offset: int, length: int) -> None:
    """Fill view[:length] from the file at offset; a direct read first, buffered for any rest."""
    direct_fd, plain_fd = fds
    done = 0
    if direct_fd >= 0:
        want = (length + ALIGN - 1) // ALIGN * ALIGN  # may run past the end of file: a short read
        try:
            done = min(os.preadv(direct_fd, [view[:want]], offset), length)
        except OSError:
            done = 0
    while done < length:
        n = os.preadv(plain_fd, [view[done:length]], offset + done)
        if n <= 0:
            raise RuntimeError("native payload ends early at byte %d" % (offset + done))
        done += n


def _close_mapping(mapped) -> None:
    try:
        mapped.close()
    except BufferError:
        pass  # a view still holds it: the collector unmaps it with the view


class NativeWeights:
    """Mixed into vLLM's worker class; every method name is prefixed to avoid clashes."""

    #: a hydration's mapping kept registered until the restore has its first token
    #: (mapping, its byte view, registered pieces, how to unregister one)
    _coldsnap_kept: tuple[Any, Any, list[tuple[int, int]], Any] | None = None

    def _coldsnap_rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

    def _coldsnap_model(self):
        get = getattr(self, "get_model", None)
        return get() if callable(get) else self.model_runner.model

    def _coldsnap_index_and_tensors(self, directory: str) -> tuple[dict[str, Any], list[Any]]:
        """The payload's index, and the tensors it fills in its order (refused when the
        model's tensors are not the ones it was written from)."""
        _, index_name = payload_names(self._coldsnap_rank())
        with open(os.path.join(directory, index_name)) as f:
            index = json.load(f)
        held = _held_storages(self._coldsnap_model())
        now = [(name, t.numel()) for name, t in held]
        was = [(e["name"], e["nbytes"]) for e in index["tensors"]]
        if now != was:
            diff = next(((a, b) for a, b in zip(was, now) if a != b), (len(was), len(now)))
            raise RuntimeError("native payload does not fit this model (payload %r, model %r): capture again" % diff)
        return index, [t for _, t in held]

    def coldsnap_load_native_mapped(
        self, directory: str, piece: int = REGISTER_PIECE, threads: int = REGISTER_THREADS, keep: bool = False, follow: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Fill the tensors from DIRECTORY/rank-N.bin held in memory (preparation copied it to a
        memory file system with huge pages): the file is mapped, the mapping registered with CUDA
        (page-locked in place, no copy through bounce buffers), and every tensor copied straight
        from it by the GPU's copy engine, at the bus's speed. Huge pages keep the registration
        cheap: a few thousand pages to lock, not millions. The registration goes in pieces of
        *piece* bytes (0: one piece), *threads* at a time, each piece's copies queued as soon as
        it is registered. *keep*: the mapping stays mapped and registered until
        ``coldsnap_release_mapped`` (the restore calls it once the engine has answered), so
        letting go of it is not on the way to the first token. *follow*: the copy into memory
        is still under way (a node with nothing prepared); each tensor is copied once its bytes
        are in place (FILLING), so hydration ends moments after the last byte arrives instead of
        starting then."""
        import mmap

        import torch

        t0 = time.monotonic()
        self.coldsnap_release_mapped()  # a mapping an earlier hydration kept
        rank = self._coldsnap_rank()
        bin_name, index_name = payload_names(rank)
        ready = index_ready = None
        if follow:
            index_ready = FillWaiter(directory, index_name)
            index_ready(os.stat(os.path.join(directory, index_name)).st_size)
            ready = FillWaiter(directory, bin_name)
        index, dests = self._coldsnap_index_and_tensors(directory)
        total = int(index["bytes"])
        on_gpu = any(t.is_cuda for t in dests)
        fd = os.open(os.path.join(directory, bin_name), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size < total:
                raise RuntimeError("native payload %s is shorter than its index says" % bin_name)
            mapped = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        host = torch.frombuffer(mapped, dtype=torch.uint8)
        table = index["tensors"]
        kept: list[tuple[int, int]] = []
        t_open = time.monotonic()
        try:
            if on_gpu:
                cudart = torch.cuda.cudart()
                base = host.data_ptr()
                device = next(t.device for t in dests if t.is_cuda)

                def register(off: int, n: int) -> None:
                    # A new thread's current device is GPU 0; this worker's may be another
                    # (tensor-parallel ranks see every GPU), and its context is the one to pin in.
                    torch.cuda.set_device(device)
                    err = cudart.cudaHostRegister(base + off, n, 0)
                    if int(err) != 0:
                        raise RuntimeError("cudaHostRegister of %d bytes at offset %d failed (error %d)" % (n, off, int(err)))

                def unregister(off: int, n: int) -> None:
                    torch.cuda.current_stream().synchronize()  # no copy may still read the piece
                    cudart.cudaHostUnregister(base + off)

                def copy(i: int, a: int, b: int) -> None:
                    at = a - table[i]["offset"]
                    dests[i][at : at + b - a].copy_(host[a:b], non_blocking=True)

                report = copy_while_registering(
                    table, total, register=register, unregister=unregister, copy=copy,
                    finish=torch.cuda.current_stream().synchronize, piece=piece or total, threads=threads, kept=kept if keep else None, ready=ready,
                )  # fmt: skip
                if kept:
                    self._coldsnap_kept = (mapped, host, kept, unregister)
            else:
                t_copy = time.monotonic()
                for e, t in zip(table, dests):
                    if ready is not None:
                        ready(e["offset"] + e["nbytes"])
                    t.copy_(host[e["offset"] : e["offset"] + e["nbytes"]])
                report = {"register_seconds": 0.0, "copy_seconds": round(time.monotonic() - t_copy, 4), "pieces": 0}
        finally:
            if not kept:
                host = None  # the last view of the mapping (the copy closure sees it too), so it unmaps now
                _close_mapping(mapped)
        t_end = time.monotonic()
        return {
            "rank": rank, "bytes": total, "tensors": len(dests), "seconds": round(t_end - t0, 4), "mapped": True,
            "open_seconds": round(t_open - t0, 4), "kept": bool(kept), "followed": follow, "fill_wait_seconds": round(ready.waited + index_ready.waited, 4) if ready and index_ready else 0.0, **report,
        }  # fmt: skip

    def coldsnap_release_mapped(self) -> dict[str, Any]:
        """Unregister and unmap what ``coldsnap_load_native_mapped(keep=True)`` kept."""
        kept = getattr(self, "_coldsnap_kept", None)
        self._coldsnap_kept = None
        if kept is None:
            return {"rank": self._coldsnap_rank(), "released_bytes": 0, "seconds": 0.0}
        t0 = time.monotonic()
        mapped, host, pieces, unregister = kept
        del kept
        try:
            for off, n in pieces:
                unregister(off, n)
        finally:
            del host  # the last view of the mapping goes first, so it can be unmapped
            _close_mapping(mapped)
        return {"rank": self._coldsnap_rank(), "released_bytes": sum(n for _, n in pieces), "seconds": round(time.monotonic() - t0, 4)}

    def coldsnap_export_native(self, directory: str) -> dict[str, Any]:
        """Write this worker's loaded tensors to DIRECTORY/rank-N.{bin,json}."""
        import torch

        rank = self._coldsnap_rank()
        bin_name, index_name = payload_names(rank)
        held = _held_storages(self._coldsnap_model())
        table = layout((name, t.numel()) for name, t in held)
        t0 = time.monotonic()
        with open(os.path.join(directory, bin_name), "wb") as f:
            for _name, t in held:
                f.write(memoryview(t.to("cpu").numpy()))
            f.flush()
            os.fsync(f.fileno())
        total = sum(e["nbytes"] for e in table)
        index = {"format": FORMAT, "rank": rank, "bytes": total, "torch": torch.__version__, "tensors": table}
        with open(os.path.join(directory, index_name), "w") as f:
            json.dump(index, f)
        return {"rank": rank, "bytes": total, "tensors": len(table), "seconds": round(time.monotonic() - t0, 4)}

    def coldsnap_load_native(self, directory: str, cached: bool = False) -> dict[str, Any]:
        """Read DIRECTORY/rank-N.bin back into the tensors it was written from; *cached*: the
        file was just read into the page cache, so buffered reads copy it from memory where
        direct I/O would read the disk again."""
        import torch

        t0 = time.monotonic()
        rank = self._coldsnap_rank()
        bin_name, _ = payload_names(rank)
        index, dests = self._coldsnap_index_and_tensors(directory)
        table = index["tensors"]
        on_gpu = any(t.is_cuda for t in dests)
        slots = [_aligned_buffer(CHUNK, pin=on_gpu) for _ in range(READERS)]
        path = os.path.join(directory, bin_name)
        direct_fd, direct = _open_for_reading(path, direct=not cached)
        plain_fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if direct else direct_fd
        direct = direct and all(s.data_ptr() % ALIGN == 0 for s in slots)
        fds = (direct_fd if direct else -1, plain_fd)
        plan = chunks(index["bytes"], CHUNK)
        offsets = [e["offset"] for e in table]
        consumed = [0]
        turn = threading.Condition()

        def read(i: int):
            # Chunk i reuses slot i % READERS: it waits until chunk i - READERS was copied out.
            with turn:
                turn.wait_for(lambda: consumed[0] > i - READERS)
            slot = slots[i % READERS]
            off, n = plan[i]
            _read_into(fds, memoryview(slot.numpy()), off, n)
            return slot

        # A chunk's slot is handed back once its copies to the device are done. That is waited
        # for one chunk late, so the copy of chunk i runs while chunk i + 1 is still being read.
        done_events: list[Any] = [None] * len(plan)

        def hand_back(i: int) -> None:
            if done_events[i] is not None:
                done_events[i].synchronize()
            with turn:
                consumed[0] = i + 1
                turn.notify_all()

        pool = ThreadPoolExecutor(READERS)
        try:
            futures = [pool.submit(read, i) for i in range(len(plan))]
            for i, fut in enumerate(futures):
                slot = fut.result()
                off, n = plan[i]
                for k, src, dst, length in copies_for(off, n, table, offsets):
                    dests[k][dst : dst + length].copy_(slot[src : src + length], non_blocking=on_gpu)
                if on_gpu:
                    done_events[i] = torch.cuda.Event()
                    done_events[i].record()
                if i > 0:
                    hand_back(i - 1)
            if plan:
                hand_back(len(plan) - 1)
        except BaseException:
            with turn:  # release every waiting reader so the pool can wind down
                consumed[0] = len(plan) + READERS
                turn.notify_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(plain_fd)
            if direct_fd != plain_fd:
                os.close(direct_fd)
        seconds = time.monotonic() - t0
        return {"rank": rank, "bytes": index["bytes"], "tensors": len(table), "seconds": round(seconds, 4), "direct_io": direct}
