"""The host end of a multi-unit capture or restore: one step on the host a unit runs on.

The coordinator reaches a unit's host only through sparkrun's transport, and what touches
the unit's process tree has to run beside it: CRIU (``/proc``, sockets, mounts, the network
lock of that host's namespace), the files the tree maps, its images, the rank's records in
the host's own ``~/.cache/sparkrun``. Each step is this module run on that host,

    python -m sparkrun_coldsnap.integration.unit_agent VERB   < request.json   > answer.json

one JSON document in, one out; a failure answers ``{"error": ..., "code": ...}`` with exit
status 1, the error in one line. The plugin is installed on every host of a cluster, as
sparkrun is, at the same path (the coordinator calls its own interpreter's path there).

Verbs: ``root`` (the pid sparkrun's local executor recorded for a rank), ``files`` (what the
tree maps or holds open), ``dump`` (CRIU of the stopped tree at the cut, its connections to
the other hosts' units included; a capture's dump ends the tree, so CRIU keeps what it needs
of files deleted while open, such as a POSIX semaphore's ``link_remap`` in ``/dev/shm``,
which a dump that leaves the tree running removes again), ``pack`` (zero pages left out, layers written), ``admit``
(admission of one unit with this host's own fingerprint), ``inbox`` and ``stage`` (layers
received, verified and unpacked), ``restore``, ``adopt`` (a restored tree recorded as the
rank, so sparkrun's ``status``/``stop`` find it), ``io_uring_off``/``io_uring_back``,
``remove``, ``drop_page_cache`` (before a benchmark's sample), ``capture_facts`` (whether the
driver can capture here, and this host's fingerprint of the workload).

For drivers with device state apart from the images (n610), each step of the cut on the
unit's devices is a verb of its own, so the coordinator can take every host through one step
before any host takes the next: ``devices_lock``, ``devices_checkpoint``, ``devices_resume``
(after a failed cut), ``devices_restore``, ``devices_unlock``. A native weight payload written
by ranks on several hosts is staged, recorded and placed on each host: ``native_staging``,
``native_part``, ``native_place`` (``weights/native_parts.py``).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.errors import ColdsnapError, RequestError

Verb = Callable[[dict[str, Any]], dict[str, Any]]


def _quiet(_: str) -> None:
    pass


def root(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.integration.records import registered_pid

    return {"pid": registered_pid(str(doc["name"]))}


def files(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host import file_drift
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.integration.records import local_record_paths

    # The rank's own log grows while it serves: a restore hands it the log again, not as captured.
    skip = [*(doc.get("skip") or ()), *([str(local_record_paths(str(doc["name"]))[1])] if doc.get("name") else [])]
    recorded = file_drift.record(tree_pids(int(doc["root_pid"])), skip=skip)
    return {"files": [f.model_dump(mode="json") for f in recorded]}


def dump(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.drivers.criu_tool import Criu

    image = criu_tree.dump(
        Criu.locate(), int(doc["root_pid"]), Path(doc["images"]), unit=str(doc["unit"]), host=str(doc["host"]), driver=str(doc["driver"]),
        progress=_quiet, leave_running=bool(doc.get("leave_running")), peers=True,
    )  # fmt: skip
    return {"image": image.model_dump(mode="json")}


def pack(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap import extensions
    from sparkrun_coldsnap.capsule.pack import pack_unit

    images, out = Path(doc["images"]), Path(doc["out"])
    compacted = extensions.registry().driver(str(doc["driver"])).compact_images(images) if doc.get("zero_pages", True) else None
    image_bytes = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
    out.mkdir(parents=True, exist_ok=True)
    layers = pack_unit(images, str(doc["unit"]), out)
    return {
        "image_bytes": image_bytes,
        "zero_pages": compacted,
        "layers": [{"path": str(l.path), "digest": l.digest, "size": l.size, "media_type": l.media_type, "annotations": l.annotations} for l in layers],
    }


def admit(doc: dict[str, Any]) -> dict[str, Any]:
    """Admission of one unit of a capsule on this host: its fingerprint, its captured PIDs and
    shared files, its files, the model files here (what the rank running now holds is freed
    by its eviction, so it does not count)."""
    from sparkrun_coldsnap.capsule.config import CapsuleConfig
    from sparkrun_coldsnap.compat.admission import admission
    from sparkrun_coldsnap.controller.common import resolve
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.documents.request import RestoreRequest
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.weights import native_parts

    cfg = CapsuleConfig.model_validate(doc["config"])
    req = RestoreRequest.model_validate(doc["request"])
    unit = next(u for u in cfg.units if u.name == doc["unit"])
    r = resolve(req.workload, settings_mod.current())
    here = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
    replacing = frozenset(p for _, leader in _recorded(str(doc["pattern"])) for p in tree_pids(leader))
    weights = cfg.weights
    if weights.native is not None and unit.driver_data.get("native_files") is not None:
        # This host holds the payload files its own ranks wrote, not the other hosts'.
        weights = weights.model_copy(update={"native": native_parts.only(weights.native, unit.driver_data["native_files"])})
    problems, choice = admission(cfg.model_copy(update={"units": (unit,), "weights": weights}), req, here, r.driver, r.adapter, replacing=replacing)
    # Restored into this host's namespaces (the ranks reach each other at the captured
    # addresses): the captured PIDs and shared files must be free here.
    problems += [p for p in criu_tree.restore_problems(unit, replacing=replacing) if p not in problems]
    answer: dict[str, Any] = {"problems": problems}
    if not problems:
        answer["restore_tools"] = r.driver.ready_tools()
    if choice is not None:
        answer["weights"] = {"path": choice.path, "native_dir": str(choice.native_dir) if choice.native_dir else None, "note": choice.note}
    return answer


def _recorded(pattern: str) -> list[tuple[str, int]]:
    """The ranks sparkrun's local executor recorded here under names matching *pattern* whose
    process group leader runs (a restored tree included), as (name, pid).

    A rank's name holds its run's placement token, which another run of the same recipe need
    not share: the workload a restore replaces is found by the recipe's part of the name."""
    import os

    import psutil

    from sparkrun_coldsnap.integration.records import local_record_paths

    pids = local_record_paths("x")[0].parent
    out = []
    for pidfile in sorted(pids.glob(pattern + ".pid")):
        try:
            pid = int(pidfile.read_text().strip())
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and os.getpgid(pid) == pid:
                out.append((pidfile.name[: -len(".pid")], pid))
        except (OSError, ValueError, psutil.Error):
            continue
    return out


def recorded(doc: dict[str, Any]) -> dict[str, Any]:
    return {"ranks": [{"name": n, "pid": p} for n, p in _recorded(str(doc["pattern"]))]}


def abort_connections(doc: dict[str, Any]) -> dict[str, Any]:
    """The TCP connections of the ranks recorded here under *pattern* ended at once, before
    they are stopped for a restore (host/connections.py says why)."""
    from sparkrun_coldsnap.host import connections
    from sparkrun_coldsnap.host.process_tree import tree_pids

    held = connections.held_connections(p for _, leader in _recorded(str(doc["pattern"])) for p in tree_pids(leader))
    return {"aborted": len(held), "problems": connections.abort(held)}


def inbox(doc: dict[str, Any]) -> dict[str, Any]:
    """A private directory for the layers about to be sent here."""
    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.host import paths
    from sparkrun_coldsnap.host.atomic import owned_prefix

    base = paths.run_dir() / "units"
    base.mkdir(parents=True, exist_ok=True)
    received = CapsuleStore(Path(tempfile.mkdtemp(prefix=owned_prefix("inbox-"), dir=base)))
    received.blobs.mkdir(parents=True)
    # Laid out as a store's blobs are: each layer is verified as it is read, as from a store.
    return {"path": str(received.root), "blobs": str(received.blobs)}


def stage(doc: dict[str, Any]) -> dict[str, Any]:
    """Verify and unpack the layers sent to ``inbox`` (memory-backed staging when there is
    room); the layers received are removed once unpacked."""
    from sparkrun_coldsnap.capsule.pack import unpack_layer
    from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
    from sparkrun_coldsnap.host import paths
    from sparkrun_coldsnap.host.atomic import owned_prefix

    received = Path(doc["inbox"])
    descs = [Descriptor.from_json(d) for d in doc["layers"]]
    unpacked = int(doc.get("unpacked_bytes") or 0)
    memory = paths.memory_staging(unpacked)
    staging = paths.new_memory_staging(memory, owned_prefix("restore-")) if memory is not None else Path(tempfile.mkdtemp(prefix=owned_prefix("restore-"), dir=received.parent))
    try:
        written = sum(unpack_layer(CapsuleStore(received), d, staging / "units") for d in descs)
    except BaseException:
        paths.remove_staging(staging)
        raise
    finally:
        paths.remove_staging(received)
    return {"staging": str(staging), "images": str(staging / "units" / str(doc["unit"])), "bytes": written}


def restore(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.drivers.base import UnitImage
    from sparkrun_coldsnap.drivers.criu_tool import Criu
    from sparkrun_coldsnap.errors import RestoreError
    from sparkrun_coldsnap.integration.records import local_record_paths

    unit = UnitImage.model_validate(doc["image"])
    # The dumped tree's processes must be gone, not zombies waiting for the host's init.
    held = criu_tree.pid_problems(unit.pids, zombie_wait=float(doc.get("zombie_wait", 30.0)))
    if held:
        raise RestoreError("; ".join(held))
    _, log_path = local_record_paths(str(doc["name"]))  # the rank's own log: sparkrun logs reads it
    details: dict[str, Any] = {}
    # The tree comes back stopped as it was dumped at the cut, its AMX tile permission given
    # back before the coordinator continues it.
    pid, _ = criu_tree.restore(Criu.locate(), unit, Path(doc["images"]), log_path=log_path, progress=_quiet, details=details)
    return {"pid": pid, "details": details}


def network_lock(doc: dict[str, Any]) -> dict[str, Any]:
    """Hold back the packets of the unit's connections to other hosts (host/peer_lock.py says why)."""
    from sparkrun_coldsnap.host import peer_lock

    peer_lock.lock([_connection(c) for c in doc["connections"]])
    return {}


def network_unlock(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host import peer_lock

    return {"problems": peer_lock.unlock([_connection(c) for c in doc["connections"]])}


def _connection(c: list[Any]) -> tuple[str, int, str, int]:
    return str(c[0]), int(c[1]), str(c[2]), int(c[3])


def adopt(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.integration.records import register_local

    return {"pidfile": str(register_local(str(doc["name"]), int(doc["pid"])))}


def capture_facts(doc: dict[str, Any]) -> dict[str, Any]:
    """Whether the request's driver can capture on this host, and this host's fingerprint of the
    workload (what a capsule records and every host's admission compares with its own)."""
    from sparkrun_coldsnap.controller.common import resolve
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.documents.request import CaptureRequest
    from sparkrun_coldsnap.host.facts import host_facts

    req = CaptureRequest.model_validate(doc["request"])
    r = resolve(req.workload, settings_mod.current())
    support = r.driver.support(host_facts())
    fingerprint = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
    return {"supported": support.ok, "reason": support.reason, "fingerprint": fingerprint.model_dump(mode="json")}


def _driver(doc: dict[str, Any]) -> Any:
    from sparkrun_coldsnap import extensions

    return extensions.registry().driver(str(doc["driver"]))


def devices_lock(doc: dict[str, Any]) -> dict[str, Any]:
    """Lock the device users of the unit's tree (a cut across hosts: every unit before any checkpoint)."""
    return {"data": _driver(doc).lock_devices(int(doc["root_pid"]))}


def devices_checkpoint(doc: dict[str, Any]) -> dict[str, Any]:
    _driver(doc).checkpoint_devices(dict(doc["data"]))
    return {}


def devices_resume(doc: dict[str, Any]) -> dict[str, Any]:
    """After a cut that failed: the unit's device users back to running; what could not be."""
    return {"problems": _driver(doc).resume_devices(dict(doc["data"]), state=str(doc["state"]))}


def devices_restore(doc: dict[str, Any]) -> dict[str, Any]:
    _driver(doc).restore_devices(dict(doc["data"]), visible=doc.get("visible"))
    return {}


def devices_unlock(doc: dict[str, Any]) -> dict[str, Any]:
    _driver(doc).unlock_devices(dict(doc["data"]))
    return {}


def native_staging(doc: dict[str, Any]) -> dict[str, Any]:
    """The directory the engine's ranks on this host write their native payload into."""
    from sparkrun_coldsnap.weights import native_parts

    return {"path": str(native_parts.staging(str(doc["token"])))}


def native_part(doc: dict[str, Any]) -> dict[str, Any]:
    """The payload files the ranks of this host wrote into the staging directory."""
    from sparkrun_coldsnap.weights import native_parts

    return {"files": [f.model_dump(mode="json") for f in native_parts.part(Path(doc["path"]))]}


def native_place(doc: dict[str, Any]) -> dict[str, Any]:
    """This host's part moved under the whole payload's digest; its directory."""
    from sparkrun_coldsnap.capsule.config import NativePayload
    from sparkrun_coldsnap.weights import native_parts

    record = NativePayload.model_validate(doc["record"])
    return {"directory": str(native_parts.place(Path(doc["path"]), record, [str(n) for n in doc["names"]]))}


def io_uring_off(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host.iouring import hold_off

    by = doc.get("coordinator")
    return {"previous": hold_off(str(doc["token"]), by if isinstance(by, dict) else None)}


def io_uring_back(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host.iouring import let_go

    return {"restored": let_go(str(doc["token"]))}


def drop_page_cache(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.weights.page_cache import drop

    drop()
    return {}


def remove(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host import paths

    for p in doc.get("paths") or ():
        paths.remove_staging(Path(p))
    return {}


VERBS: dict[str, Verb] = {
    "root": root, "recorded": recorded, "abort_connections": abort_connections, "files": files, "dump": dump, "pack": pack, "admit": admit, "inbox": inbox, "stage": stage,
    "restore": restore, "adopt": adopt, "network_lock": network_lock, "network_unlock": network_unlock, "io_uring_off": io_uring_off, "io_uring_back": io_uring_back, "remove": remove,
    "drop_page_cache": drop_page_cache, "capture_facts": capture_facts,
    "devices_lock": devices_lock, "devices_checkpoint": devices_checkpoint, "devices_resume": devices_resume,
    "devices_restore": devices_restore, "devices_unlock": devices_unlock,
    "native_staging": native_staging, "native_part": native_part, "native_place": native_place,
}  # fmt: skip


def main(argv: list[str]) -> int:
    try:
        if len(argv) != 1 or argv[0] not in VERBS:
            raise RequestError("unit agent: name one verb of %s" % ", ".join(sorted(VERBS)))
        answer = VERBS[argv[0]](json.loads(sys.stdin.read() or "{}"))
    except ColdsnapError as err:
        print(json.dumps({"error": err.message, "code": err.code}))
        return 1
    except Exception as err:  # noqa: BLE001 - the coordinator reports it, naming the host
        print(json.dumps({"error": "%s: %s" % (type(err).__name__, err), "code": "agent.unexpected"}))
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
