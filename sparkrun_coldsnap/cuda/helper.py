"""The long-lived CUDA checkpoint helper: runs in a Python that has ``cuda-bindings``.

It is a separate process because the calls act on *other* processes and need
a CUDA driver context of their own, and long-lived because every fresh
process pays about 2.5 s of ``cuInit``. It reads one JSON command per line on
stdin and answers one JSON line on stdout:

    {"op": "init"}                                   -> {"ok": true, "driver": 12090}
    {"op": "state", "pid": 123}                      -> {"ok": true, "state": "running"}
    {"op": "lock", "pid": 123, "timeout_ms": 10000}  -> {"ok": true}
    {"op": "checkpoint", "pid": 123}
    {"op": "restore", "pid": 123, "pairs": [["GPU-old", "GPU-new"]]}
    {"op": "unlock", "pid": 123}
    {"op": "restore_many", "pids": [1, 2], "pairs": [...], "parallel": true}
                                                     -> {"ok": true, "seconds": {"1": 0.4, "2": 0.2}}
    {"op": "uuids"}                                  -> {"ok": true, "uuids": ["GPU-..."]}
Failures answer {"ok": false, "error": "CUDA_ERROR_..."}; a call on several processes also
names the one that failed and the step (``"pid"``, ``"op"``).

Standalone on purpose (no imports from the plugin): it runs in the engine's
environment, which does not have the plugin installed.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
import uuid as uuidlib

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as driver
    return driver


class CallFailed(RuntimeError):
    """A call on one process of several failed: the answer names the process and the call."""

    def __init__(self, error: str, **fields) -> None:
        super().__init__(error)
        self.fields = fields


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        name = getattr(err, "name", None) or str(err)
        raise RuntimeError(name)
    return result[1:] if isinstance(result, tuple) else ()


def _uuid_bytes(text: str) -> bytes:
    return uuidlib.UUID(text.replace("GPU-", "")).bytes


def _side_by_side(fn, items):
    """fn(item) for every item, each on a thread of its own; the results in order."""
    out = [None] * len(items)

    def run(i):
        out[i] = fn(items[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class Helper:
    def __init__(self) -> None:
        self.d = _driver()

    def init(self, msg):
        _check(self.d.cuInit(0))
        (version,) = _check(self.d.cuDriverGetVersion())
        return {"driver": int(version)}

    def modules(self, msg):
        """The files of the modules this helper has loaded: the compiled ones it read, and their
        sources, which the import system looks at. (What it maps, the controller reads itself.)"""
        found = set()
        for module in list(sys.modules.values()):
            for attr in ("__file__", "__cached__"):
                path = getattr(module, attr, None)
                if isinstance(path, str):
                    found.add(path)
        return {"files": sorted(found)}

    def uuids(self, msg):
        (count,) = _check(self.d.cuDeviceGetCount())
        out = []
        for i in range(int(count)):
            (dev,) = _check(self.d.cuDeviceGet(i))
            (u,) = _check(self.d.cuDeviceGetUuid(dev))
            raw = bytes(u.bytes) if hasattr(u, "bytes") else bytes(u)
            out.append("GPU-" + str(uuidlib.UUID(bytes=raw[:16])))
        return {"uuids": out}

    def state(self, msg):
        (st,) = _check(self.d.cuCheckpointProcessGetState(int(msg["pid"])))
        return {"state": STATES.get(int(st), str(int(st)))}

    def lock(self, msg):
        args = self.d.CUcheckpointLockArgs()
        args.timeoutMs = int(msg.get("timeout_ms", 0))
        _check(self.d.cuCheckpointProcessLock(int(msg["pid"]), args))
        return {}

    def checkpoint(self, msg):
        _check(self.d.cuCheckpointProcessCheckpoint(int(msg["pid"]), None))
        return {}

    def _uuid(self, text):
        # CUuuid exposes its 16 bytes read-only: write them through the struct's address.
        u = self.d.CUuuid()
        ctypes.memmove(u.getPtr(), _uuid_bytes(text), 16)
        return u

    def restore(self, msg):
        pairs = msg.get("pairs") or []
        args = None
        if pairs:
            args = self.d.CUcheckpointRestoreArgs()
            gpu_pairs = []
            for old, new in pairs:
                p = self.d.CUcheckpointGpuPair()
                p.oldUuid = self._uuid(old)
                p.newUuid = self._uuid(new)
                if bytes(p.oldUuid.bytes) != _uuid_bytes(old) or bytes(p.newUuid.bytes) != _uuid_bytes(new):
                    raise RuntimeError("cuda-bindings did not take the GPU pair %s -> %s" % (old, new))
                gpu_pairs.append(p)
            args.gpuPairs = gpu_pairs
            args.gpuPairsCount = len(gpu_pairs)
        _check(self.d.cuCheckpointProcessRestore(int(msg["pid"]), args))
        return {}

    def unlock(self, msg):
        _check(self.d.cuCheckpointProcessUnlock(int(msg["pid"]), None))
        return {}

    def restore_many(self, msg):
        """Restore every process, then unlock every one; with "parallel" each step runs on
        every process at once. A restore is carried out by the restored process's own
        thread (the call waits for it), so the processes' device state goes back side by
        side. The first failure is answered, naming its process; none is unlocked then."""
        pids = [int(p) for p in msg["pids"]]
        seconds = {}

        def each(op, pid):
            t = time.monotonic()
            try:
                getattr(self, op)({"pid": pid, "pairs": msg.get("pairs") or []})
            except Exception as err:  # noqa: BLE001 - answered with the process it concerns
                return CallFailed(str(err), pid=pid, op=op)
            seconds[str(pid)] = round(seconds.get(str(pid), 0.0) + time.monotonic() - t, 4)
            return None

        for op in ("restore", "unlock"):
            if msg.get("parallel"):
                errors = _side_by_side(lambda pid, op=op: each(op, pid), pids)
            else:
                errors = []
                for pid in pids:
                    errors.append(each(op, pid))
                    if errors[-1]:
                        break
            failed = [e for e in errors if e]
            if failed:
                raise failed[0]
        return {"seconds": seconds}


def main() -> int:
    try:
        helper = Helper()
    except Exception as err:  # noqa: BLE001 - reported to the controller, which explains it
        print(json.dumps({"ok": False, "error": "cannot load cuda-bindings: %s" % err}), flush=True)
        return 1
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "quit":
            return 0
        try:
            out = getattr(helper, op)(msg)
            print(json.dumps({"ok": True, **out}), flush=True)
        except Exception as err:  # noqa: BLE001 - every failure becomes an answer
            print(json.dumps({"ok": False, "error": str(err), **getattr(err, "fields", {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
