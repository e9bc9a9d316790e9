"""FAKE CUDA context (tests only): what a CUDA process does that the checkpoint API sees.

A process that calls :func:`attach` behaves, towards the fake driver in
``cuda/bindings/driver.py``, as a process with a CUDA context does towards the real one.
Its checkpoint state lives in its own memory, as libcuda's does, so a process restored
from images is in the state it was dumped in. A thread of the process carries out the
driver's calls on it under the driver's rules (see the driver's docstring): it holds its
GPU's device file open, its kernels wait while it is locked or checkpointed, it lets go
of the device file when checkpointed and opens it again, on the GPU the restore's pairs
name, when restored; a GPU that is gone leaves it FAILED.

A test can tell the fake host's checkpoints or restores to fail
(:func:`fake_gpu_state.tell_to_fail`): the process then answers the CUDA error it was told,
before anything moved, and stays where it was (locked; checkpointed), as when the memory that
would hold its device state cannot be had.

Device memory shared with another process (CUDA IPC: what NCCL's P2P transport and the
engines' custom all-reduce kernels set up, :meth:`FakeCudaContext.share_with`) is what
the driver's checkpoint cannot carry before driver 610: a call on such a process does not
fail, it waits while a peer is locked or checkpointed (NVIDIA/cuda-checkpoint#30), and
its checkpoint waits while a peer runs (#45). Here too.

A driver that loses kept communicators (``FAKE_CUDA_KEPT_COMMUNICATORS=break`` in the
process's environment; by default they come through, as tensor-parallel vLLM's did on H100s,
NVIDIA/nvcf#1183): a context that holds a collective communicator
(:meth:`FakeCudaContext.hold_communicator`: NCCL's, or the ring of TCP connections that stands
for it in the fake engines) when it is checkpointed comes back broken: the restore and the
unlock succeed, the driver reports it running, and every kernel it launches afterwards fails
with "CUDA error: unspecified launch failure", the GPU machine's words for what two NCCL ranks
sharing one H100 did after the same cut (driver 580.159.04, NCCL 2.28.9; docs/gpu-ranks.md).
It is the driver NCCL's own checkpoint support assumes (every communicator destroyed before the
lock, made again after the unlock), the one ``COLDSNAP_COMMUNICATORS=rebuild`` is for. A context
that held no communicator at its checkpoint is unaffected, and so is work that launches no
kernel (mapping memory, copies to and from the host: :meth:`FakeCudaContext.transfer`), as the
restored ranks there took their weights back and died at their first kernel. (On that one
shared GPU, ranks that destroyed their communicators before the lock failed the same way; this
fake does not model that.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import fake_gpu_state as gpu

#: what a kernel of a context broken by a kept communicator fails with (the GPU machine's words)
LAUNCH_FAILURE = "CUDA error: unspecified launch failure"


class CudaError(RuntimeError):
    """A CUDA call that failed (torch raises RuntimeError with the CUDA error's text)."""


class FakeCudaContext:
    def __init__(self, device: int = 0) -> None:
        """A context on the *device*-th GPU this process sees (``torch.cuda.set_device``)."""
        self.pid = os.getpid()
        every = gpu.gpus()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = [every[int(i)] for i in visible.split(",")] if visible else every
        mine = seen[device]
        self.fd: int | None = os.open(mine["device"], os.O_RDWR)
        self.state = "running"
        self.gpus = [mine]
        self.ipc_peers: list[int] = []
        self.communicator = False  # a collective communicator lives in this context now
        self.broken = False  # checkpointed while it held one: no kernel runs again
        self.host_gpus = [{"uuid": g["uuid"], "chip": g["chip"]} for g in every]
        self.busy = 0
        self.cond = threading.Condition()
        self.answered: str | None = None
        self._report()
        threading.Thread(target=self._answer_driver, daemon=True).start()

    def _report(self) -> None:
        gpu.write_proc(
            self.pid,
            {"state": self.state, "gpus": self.gpus, "host_gpus": self.host_gpus, "ipc_peers": self.ipc_peers, "communicator": self.communicator, "broken": self.broken},
        )

    def hold_communicator(self, held: bool) -> None:
        """The process created (True) or destroyed (False) its collective communicator in this
        context; where it holds one at a checkpoint, the context comes back broken."""
        with self.cond:
            self.communicator = held
            self._report()

    def share_with(self, peer: int) -> None:
        """Map device memory of *peer* (and let it map this process's): CUDA IPC."""
        if peer not in self.ipc_peers:
            self.ipc_peers.append(peer)
            self._report()

    def _peer_states(self) -> list[str]:
        out = []
        for peer in self.ipc_peers:
            try:
                os.kill(peer, 0)
            except ProcessLookupError:
                continue
            rec = gpu.read_proc(peer)
            out.append(rec["state"] if rec else "running")
        return out

    def _blocked(self, op: str) -> bool:
        """The driver's call waits: a peer sharing memory is frozen, or (a checkpoint) still runs."""
        states = self._peer_states()
        if any(st in ("locked", "checkpointed") for st in states):
            return True
        return op == "checkpoint" and any(st == "running" for st in states)

    def _answer_driver(self) -> None:
        path = gpu.request_path(self.pid)
        seen: tuple[int, int, int] | None = None
        pending: dict | None = None
        while True:
            # The request file is opened only when a new one came. CRIU freezes the process at
            # any instruction; a request file it found open would be restored only if its size
            # were the same then, and the driver writes the next request in its place.
            try:
                st = os.stat(path)
                mark: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                mark = None
            if mark is not None and mark != seen:
                seen = mark
                req = gpu.read_json(path)
                if req is not None and req["id"] != self.answered:
                    pending = req
            if pending is not None and not self._blocked(pending["op"]):
                result = self._carry_out(pending)
                self.answered = pending["id"]
                self._report()
                gpu.write_json(gpu.answer_path(self.pid), {"id": pending["id"], "result": result, "state": self.state})
                pending = None
            time.sleep(0.005)

    def _carry_out(self, req: dict) -> str:
        op = req["op"]
        if op == "state":
            return "CUDA_SUCCESS"
        if op == "lock" and self.state == "running":
            with self.cond:
                self.state = "locked"  # from here on a new kernel waits
                limit = req["timeout_ms"] / 1000 if req["timeout_ms"] else None
                deadline = time.monotonic() + limit if limit is not None else None
                while self.busy:  # the kernel in flight finishes first
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self.state = "running"
                        self.cond.notify_all()
                        return "CUDA_ERROR_TIMEOUT"
                    self.cond.wait(left)
            return "CUDA_SUCCESS"
        if op == "checkpoint" and self.state == "locked":
            told = gpu.told_to_fail("checkpoint")
            if told:
                return told  # refused before anything moved: still locked, as it was
            assert self.fd is not None
            os.close(self.fd)  # device memory now lives in host memory; the handles go
            self.fd = None
            self.state = "checkpointed"
            if self.communicator and os.environ.get("FAKE_CUDA_KEPT_COMMUNICATORS") == "break":
                self.broken = True  # the driver answers success; the kernels after the restore fail
            return "CUDA_SUCCESS"
        if op == "restore" and self.state == "checkpointed":
            told = gpu.told_to_fail("restore")
            if told:
                return told  # refused before anything moved: still checkpointed
            after = self._remap(req["pairs"])
            if after is None:
                return "CUDA_ERROR_INVALID_VALUE"
            try:
                self.fd = os.open(after[0]["device"], os.O_RDWR)
            except OSError:
                self.state = "failed"  # the GPU is gone: nothing brings this process back
                return "CUDA_ERROR_UNKNOWN"
            self.gpus, self.state = after, "locked"
            return "CUDA_SUCCESS"
        if op == "unlock" and self.state == "locked":
            with self.cond:
                self.state = "running"
                self.cond.notify_all()
            return "CUDA_SUCCESS"
        return "CUDA_ERROR_ILLEGAL_STATE"

    def _remap(self, pairs: list[list[str]]) -> list[dict] | None:
        """The GPUs after a restore, or None when the pairs break the driver's rules."""
        here = {g["uuid"]: g for g in gpu.gpus()}
        if not pairs:
            return [dict(here[g["uuid"]]) for g in self.gpus] if all(g["uuid"] in here for g in self.gpus) else None
        mapping = dict((old, new) for old, new in pairs)
        if len(mapping) != len(pairs) or len(set(mapping.values())) != len(mapping):
            return None  # an old GPU named twice, or two onto one
        chips = {g["uuid"]: g["chip"] for g in self.host_gpus}
        if set(chips) - set(mapping):
            return None  # every GPU of the capture host must be in the map
        for old, new in mapping.items():
            if old not in chips or new not in here or here[new]["chip"] != chips[old]:
                return None
        return [dict(here[mapping[g["uuid"]]]) for g in self.gpus]

    @contextmanager
    def kernel(self, seconds: float = 0.0) -> Iterator[None]:
        """Work on the GPU: waits while the process is locked or checkpointed, as CUDA calls do;
        fails (:data:`LAUNCH_FAILURE`) once a checkpoint broke the context."""
        with self._work(seconds, launches=True):
            yield

    @contextmanager
    def transfer(self, seconds: float = 0.0) -> Iterator[None]:
        """GPU work that launches no kernel (memory mapped or unmapped, copies to or from the
        host): waits as a kernel does, and goes through on a broken context."""
        with self._work(seconds, launches=False):
            yield

    @contextmanager
    def _work(self, seconds: float, *, launches: bool) -> Iterator[None]:
        with self.cond:
            while self.state != "running":
                self.cond.wait(0.05)
            self.busy += 1
        try:
            if self.fd is None:
                raise RuntimeError("CUDA call without a device: the context was not restored")
            if launches and self.broken:
                raise CudaError(LAUNCH_FAILURE)
            time.sleep(seconds)
            yield
        finally:
            with self.cond:
                self.busy -= 1
                self.cond.notify_all()


def attach(device: int = 0) -> FakeCudaContext:
    return FakeCudaContext(device)
